"""Write a copy of a GGUF model with its matrices in another type (F16 or Q8_0), with the gguf
package: the heavier targets that `--spec-type self:q4_0` is for, made from the 4-bit files at
hand (the values are the 4-bit model's, held in more bits: the same model, read slower).

Usage: python benchmarks/requant_copy.py SRC.gguf DST.gguf {f16,q8_0,q4_0}
(q4_0 of a Q8_0 copy: the draft file llama-speculative-simple gets for the comparison with
`--spec-type self:q4_0`, which makes the same copy in memory.)
Every 2-D tensor whose row length is a multiple of 32 becomes the target type; the rest (norms,
1-D) is copied as it is. Metadata is copied, general.file_type set (1 = F16, 7 = Q8_0, 2 = Q4_0).
"""

import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q


def main():
    src, dst, kind = sys.argv[1], sys.argv[2], sys.argv[3].lower()
    target = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[kind]
    r = gguf.GGUFReader(src)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        if name == "general.file_type":
            w.add_uint32(name, {Q.F16: 1, Q.Q8_0: 7, Q.Q4_0: 2}[target])
            continue
        if vt == gguf.GGUFValueType.ARRAY:
            et = f.types[-1]
            if et == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]) for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_array(name, vals)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_string(name, str(bytes(f.parts[-1]), "utf-8"))
        else:
            w.add_key_value(name, f.parts[-1].tolist()[0], vt)
    for t in r.tensors:
        shape = [int(x) for x in t.shape]  # ggml ne order
        if len(shape) == 2 and shape[0] % 32 == 0:
            x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [rows, k]
            x = x.reshape(shape[1], shape[0])
            if target == Q.F16:
                w.add_tensor(t.name, x.astype(np.float16))
            else:
                q = gguf.quants.quantize(x, target)
                w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=target)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
