"""Load-time repack of ggml weight blocks into the layout of the integer kernel (kernels/matmul_int.py).

Why this layout: a matrix-vector product runs fastest here with the SIMD lanes over *rows*:
one ``vpdpbusd`` multiplies 16 rows x 4 consecutive values by 4 activation bytes broadcast to
every lane, so no horizontal sum is needed, every weight byte is loaded once per token, and the
activation is one 32-bit broadcast. So R = 32 rows are interleaved per group, 4 values per row
side by side:

    q  u8 / i8 [G, n_sub, sub-block bytes], each 32-row sub-block stored as
       bytes (q8_0, iq4_nl: signed): [S / 4 steps, R, 4], one byte per value;
       nibbles (every other format): [S / 8 steps, R, 4] bytes, byte i of step s holding value
           4s + i in its low nibble and value S/2 + 4s + i in its high one; then the bits above
           the nibble, for the four 64-byte vectors of a step (rows 0-15 low nibbles, rows 16-31
           low, rows 0-15 high, rows 16-31 high):
           - 5-bit formats (q5_0, q5_1, q5_K: 1 plane): [S / 8 steps, 4 words, 8 bytes], word w of
             step s a little-endian u64 whose bit b is bit 4 of the value in byte b of vector w;
             the kernel ORs it in with one masked byte move (kernels/simd_int.bplane);
           - q6_K (2 planes): [S / 8 steps, 64 bytes], crumbs: bits 2w, 2w + 1 of byte b are bits
             4, 5 of the value in byte b of vector w; the kernel ORs them in with a shift, a mask
             and an OR per vector (simd_int.bmerge), as ggml's AVX2 q6_K dot does — on AVX2 a
             u64-mask plane costs a broadcast, a byte shuffle, a compare and two ANDs per 32 bytes.
           So a value costs its file's bits: q5_0 is held in 5 bits a value, q6_K in 6 (one byte
           each before: +45 % / +33 % over the file). q2_K and q3_K values (<= 7) fit a nibble.
    d, m  u16 [G, n_super, R]    f16 bit patterns from the file: the block scale, and the
                                 q4_1 / q5_1 offset or the K-quants' -dmin (m empty when unused)
    sc, mn  i8 [G, n_sub, R]     K-quants: each sub-block's integer scale and min (else empty)

mxfp4 is held in its file's bytes: its 4-bit codes in the nibble layout, which the kernel maps to
ggml's table kvalues_mxfp4 (the e2m1 values doubled: integers in [-12, 12]) plus 12 with one
byte shuffle (QFormat.lut, kernels/simd_int.blut), 12 * sum(x) taken off as an offset; its block
scale d is the exponent byte, u8 [G, n_super, R], read as 2^(e - 128) (GGML_E8M0_TO_FP32_HALF,
kernels/simd.vscale). So the integer dot and its float steps are ggml's vec_dot_mxfp4_q8_0
(d = x.d * e8m0_half(e), sum += d * integer dot), and the weights take their file's size.

with S the values per sub-block (32, or 16 for q2_K / q3_K / q6_K), n_sub = k / S and
n_super = k / 32 (legacy formats, one sub-block each) or k / 256 (K-quants). Values are the
file's integers (never re-quantized), moved so that they are unsigned (q4_0's q - 8 is stored
as q with offset 8, q6_K's q - 32 with offset 32 ...): ``QFormat.offset`` is subtracted as
offset * sum(x) per sub-block in the kernel, exactly. G = ceil(m / R); rows past m are zero.

``QFormat`` is the per-type description the kernel is specialised on (numba sees it as a type
whose fields are compile-time constants): values per sub-block, sub-blocks per scale, offset,
nibbles or bytes, signed bytes, which activation format (ggml's vec_dot_type: q8_0, q8_1 or
q8_K), which offset term (q8_1's s, or the K-quants' integer mins) and the bit planes.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
from numba import types
from numba.extending import NativeValue, models, register_model, typeof_impl, unbox

from kvchat.kernels.ggml_types import GGMLType, type_info

R = 32  # rows interleaved per group: 2 x 16 i32 lanes
# Bump when the packed bytes of the same file rows change. Packs cached on disk are keyed on it
# and on a digest of this module, qlayout_pack.py and repack.py (runtime/weights/cache.py).
# 2: q6_K's high bits as crumbs (were two u64-mask bit planes); 3: mxfp4 as nibbles and exponent bytes
LAYOUT_VERSION = 3
ACT_Q8_0, ACT_Q8_1, ACT_Q8_K = 0, 1, 2  # activation formats (ggml's vec_dot_type of the weight)
# KVCHAT_GGML_ORDER=1: q4_1 in ggml's AVX2 float order (kernels/matmul_lanes.py): bit-identical to
# llama.cpp's products, ~1.4x the kernel's time for one token on AVX2 (docs/performance.md, "Accuracy")
# "1" takes all of ggml's orders; a comma list takes some: q4_1 (this matmul order), q5_0 and q8_0
# (llamafile's tinyBLAS_Q0_AVX order of a batch, kernels/matmul_lanes.py), q4_K (the repacked
# gemm's order: mins summed apart, kernels/matmul_int._row4_km), q6_K (the tiled matmul's order,
# _row4_tl), flash
# (kernels/attention_ggml.py), softmax (the classic path's softmax form, kernels/attention_classic.py)
_ORDER_ENV = os.environ.get("KVCHAT_GGML_ORDER", "")
GGML_ORDER_ALL = frozenset(("q4_1", "q5_0", "q8_0", "q4_K", "q6_K", "flash", "softmax"))
GGML_ORDER_PARTS = GGML_ORDER_ALL if _ORDER_ENV == "1" else GGML_ORDER_ALL & {p.strip() for p in _ORDER_ENV.split(",")}
GGML_ORDER = "q4_1" in GGML_ORDER_PARTS
# ggml's kvalues_mxfp4 (the e2m1 values doubled: integers) + 12, so that they are unsigned (<= 24:
# the kernel's unsigned dot, no sign handling); 12 * sum(x) is taken off as a q4_0's 8 * sum(x)
MXFP4_OFFSET = 12
MXFP4_LUT = tuple(int(v) + MXFP4_OFFSET for v in (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12))
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


class QFormat(NamedTuple):
    """Compile-time description of one weight type for kernels/matmul_int.py."""

    name: str
    sub: int  # S, values per sub-block (one integer dot product)
    n_sub: int  # sub-blocks per float scale d (1: legacy blocks of 32; 8 or 16: K-quant super-blocks)
    offset: int  # subtracted from every stored value (q4_0: 8, q5_0: 16, q6_K: 32, q3_K: 4)
    nib: bool  # two values per byte
    signed: bool  # i8 values (q8_0, iq4_nl); else unsigned values <= 63
    act: int  # ACT_Q8_0 / ACT_Q8_1 / ACT_Q8_K
    lmin: bool  # + m * s (q4_1, q5_1 with q8_1's s = d * sum(q))
    kmin: bool  # + (-dmin) * dx * sum_j mn_j * sum(x of sub-block j) (q4_K, q5_K, q2_K)
    planes: int = 0  # high bits above the nibble: 1 for the 5-bit formats (a bit plane), 2 for q6_K (crumbs)
    lanes: bool = False  # ggml's x86 order: 8 float lanes per output across blocks (kernels/matmul_lanes.py)
    lut: tuple = ()  # nibble code -> stored value (16 entries, <= 63) when the file's codes index a table (mxfp4)

    @property
    def super_values(self) -> int:
        return self.sub * self.n_sub

    @property
    def sub_bytes(self) -> int:
        """Bytes of one sub-block of a row group as packed (module docstring): R rows of S values,
        two a byte plus 4 bytes a row per high-bit plane, or one a byte (read by the kernels as
        fmt_get(fmt, "sub_bytes"), a compile-time constant)."""
        return self.sub * (R // 2 + 4 * self.planes) if self.nib else self.sub * R

    @property
    def _numba_type_(self):
        """numba's dispatcher reads this instead of calling typeof (13 µs -> 0.6 µs a call)."""
        t = _NUMBA_TYPES.get(self)
        if t is None:
            t = _NUMBA_TYPES[self] = QFormatType(self)
        return t


_NUMBA_TYPES: dict = {}


FORMATS = {
    GGMLType.Q4_0: QFormat("q4_0", 32, 1, 8, True, False, ACT_Q8_0, False, False),
    GGMLType.Q4_1: QFormat("q4_1", 32, 1, 0, True, False, ACT_Q8_1, True, False, lanes=GGML_ORDER),
    GGMLType.Q5_0: QFormat("q5_0", 32, 1, 16, True, False, ACT_Q8_0, False, False, 1, lanes="q5_0" in GGML_ORDER_PARTS),
    GGMLType.Q5_1: QFormat("q5_1", 32, 1, 0, True, False, ACT_Q8_1, True, False, 1),
    GGMLType.Q8_0: QFormat("q8_0", 32, 1, 0, False, True, ACT_Q8_0, False, False, lanes="q8_0" in GGML_ORDER_PARTS),
    GGMLType.IQ4_NL: QFormat("iq4_nl", 32, 1, 0, False, True, ACT_Q8_0, False, False),
    # mxfp4: the file's e2m1 codes as nibbles, mapped by the kernel to the doubled values + 12; its
    # e8m0 exponent bytes as d (below)
    GGMLType.MXFP4: QFormat("mxfp4", 32, 1, MXFP4_OFFSET, True, False, ACT_Q8_0, False, False, lut=MXFP4_LUT),
    GGMLType.Q2_K: QFormat("q2_K", 16, 16, 0, True, False, ACT_Q8_K, False, True),
    GGMLType.Q3_K: QFormat("q3_K", 16, 16, 4, True, False, ACT_Q8_K, False, False),
    GGMLType.Q4_K: QFormat("q4_K", 32, 8, 0, True, False, ACT_Q8_K, False, True, lanes="q4_K" in GGML_ORDER_PARTS),
    GGMLType.Q5_K: QFormat("q5_K", 32, 8, 0, True, False, ACT_Q8_K, False, True, 1),
    GGMLType.Q6_K: QFormat(
        "q6_K", 16, 16, 32, True, False, ACT_Q8_K, False, False, 2, lanes="q6_K" in GGML_ORDER_PARTS
    ),
}


class QFormatType(types.Dummy):
    """numba type of a QFormat: its fields are read at compile time (kernels/matmul_int.fmt_*)."""

    def __init__(self, fmt: QFormat):
        self.fmt = QFormat(*fmt)
        super().__init__(name="qfmt(" + ",".join(str(v) for v in self.fmt) + ")")

    @property
    def key(self):
        return self.fmt


@typeof_impl.register(QFormat)
def _typeof_qformat(val, c):
    return QFormatType(val)


register_model(QFormatType)(models.OpaqueModel)


@unbox(QFormatType)
def _unbox_qformat(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


# ---- repack ---------------------------------------------------------------------------------

EMPTY_U16 = np.zeros((0, 0, 0), np.uint16)
EMPTY_I8 = np.zeros((0, 0, 0), np.int8)


class Packed(NamedTuple):
    q: np.ndarray  # u8 / i8 [G, n_sub, sub-block bytes]
    d: np.ndarray  # u16 [G, n_super, R]
    m: np.ndarray  # u16 [G, n_super, R] or empty
    sc: np.ndarray  # i8 [G, n_sub, R] or empty
    mn: np.ndarray  # i8 [G, n_sub, R] or empty


REPACK_ROWS = 8192  # rows repacked (and their file pages released) at a time, a multiple of R
_numpy_fill = None  # set by kernels/qlayout_numpy.model_repack() around a small model's first load


def sub_block_bytes(fmt: QFormat) -> int:
    """Bytes of one 32-row sub-block of q: a byte a value, or nibbles plus the bit planes."""
    if not fmt.nib:
        return fmt.sub * R
    return fmt.sub // 2 * R + fmt.planes * 4 * fmt.sub


def _read_only(a: np.ndarray) -> np.ndarray:
    """A C-ordered read-only view: model-file rows are read-only, fused copies are not, and the
    compiled pass is typed (and cached) for one of the two only."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def repack_int(raw: np.ndarray, t: int, k: int, done=None) -> tuple[QFormat, Packed]:
    """raw u8 [m, row_bytes] of block type t -> (its QFormat, the packed arrays).

    The arrays are allocated once and filled REPACK_ROWS rows at a time by one compiled pass
    (kernels/qlayout_pack.py: each byte written once, no temporaries; for a small model's first
    run, by numpy: kernels/qlayout_numpy.model_repack()); ``done(rows)`` is called
    after each slice of raw has been read (the caller releases those file pages, kernels/matmul.py)."""
    from kvchat.kernels.qlayout_pack import pack_rows

    t = GGMLType(t)
    fmt = FORMATS.get(t)
    if fmt is None:
        raise ValueError(f"matmul: ggml type {t.name} is not supported for weights")
    if t == GGMLType.MXFP4:
        return fmt, _repack_mxfp4(raw, k, done)
    m = raw.shape[0]
    g = -(-m // R)
    n_sub = k // fmt.sub
    n_super = k // fmt.super_values
    q = np.empty((g, n_sub, sub_block_bytes(fmt)), np.uint8)
    d = np.empty((g, n_super, R), np.uint16)
    has_m = fmt.lmin or fmt.kmin
    mm = np.empty((g, n_super, R), np.uint16) if has_m else EMPTY_U16
    sc = np.empty((g, n_sub, R), np.int8) if fmt.n_sub > 1 else EMPTY_I8
    mn = np.empty((g, n_sub, R), np.int8) if fmt.kmin else EMPTY_I8
    layout = (fmt.sub, fmt.n_sub, fmt.planes, fmt.nib, type_info(t).type_size)
    for r0 in range(0, max(m, 1), REPACK_ROWS):
        part = raw[r0 : r0 + REPACK_ROWS]
        if _numpy_fill is not None:
            _numpy_fill(part, t, k, r0 // R, Packed(q, d, mm, sc, mn))
        else:
            pack_rows(_read_only(part), int(t), layout, r0 // R, q, d, mm, sc, mn)
        if done is not None:
            done(part)
    return fmt, Packed(q.view(np.int8) if fmt.signed else q, d, mm, sc, mn)


def _repack_mxfp4(raw: np.ndarray, k: int, done=None) -> Packed:
    """mxfp4 rows raw u8 [m, k / 32 * 17] -> Packed (q u8 [G, k / 32, 16 * R]: the file's code
    bytes in the nibble layout, d u8 [G, k / 32, R]: the exponent bytes; rows past m zero), REPACK_ROWS
    rows at a time with numpy (no compiled pass: the existing formats' pack_rows stays as it is).
    A block's 16 code bytes already pair value j (low nibble) with value 16 + j (high): the layout's
    byte (step s, row r, i) is the row's code byte 4 s + i, so the bytes are only moved."""
    m = raw.shape[0]
    g = -(-m // R)
    nb = k // 32
    q = np.zeros((g, nb, 16 * R), np.uint8)
    d = np.zeros((g, nb, R), np.uint8)
    for r0 in range(0, m, REPACK_ROWS):
        part = raw[r0 : r0 + REPACK_ROWS]
        n = part.shape[0]
        blocks = np.zeros((-(-n // R) * R, nb, 17), np.uint8)  # [rows, nb, 17] padded to whole groups
        blocks[:n] = part.reshape(n, nb, 17)
        g0, gn = r0 // R, blocks.shape[0] // R
        # [gn, R, nb, 4 steps, 4] -> [gn, nb, 4 steps, R, 4]
        q[g0 : g0 + gn] = blocks[:, :, 1:].reshape(gn, R, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(gn, nb, 16 * R)
        d[g0 : g0 + gn] = blocks[:, :, 0].reshape(gn, R, nb).transpose(0, 2, 1)
        if done is not None:
            done(part)
    return Packed(q, d, EMPTY_U16, EMPTY_I8, EMPTY_I8)
