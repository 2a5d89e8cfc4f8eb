#!/usr/bin/env bash
# Prepare the GPU proof kit's one call: the wheels the GPU machine lacks, in .gpu-wheels/ (git-ignored),
# built for its platform (Python 3.12, manylinux x86_64), checked against the 64 MiB carry limit; then
# prints the exact `device` run call (command and carry).
#
#   bash benchmarks/gpu/prepare.sh            # from the repository root; needs PyPI and pip
#
# The machine's image (benchmarks/gpu/device_packages.txt) holds torch 2.11 + CUDA 13, triton, transformers,
# peft, safetensors, numpy, psutil, ...; not SwissArmyTransformer, DeepSpeed, bitsandbytes nor their own
# needs listed below. DeepSpeed has no wheel on PyPI: its sdist is built here into a pure-Python wheel
# (DS_BUILD_OPS=0: no compiled ops; the proof uses none). wandb and datasets, which `import sat` imports,
# are not carried (wandb alone is 20 MB): proof.py stands in a module for each, which the proof never calls.
#
# Parts p (the peer beside us) and h (the README's Hugging Face recipes) run the released model's own HF code,
# which predates the image's transformers 5.x, with the recipes' version set (the image's accelerate 1.x breaks
# the 4-bit recipe): PEER_WHEELS go to .gpu-wheels/peer/ and are installed into a folder of their own (--target /tmp/peer),
# which proof.py puts first on sys.path in that part only (--peer-site), so the image's transformers stays
# as it is for everything else. That code is not ours to ship: set HF_CODE to a local copy of
# cogvlm-chat-hf's modeling_cogvlm.py, visual.py and configuration_cogvlm.py (a public copy, fetched
# beforehand) and they are copied into .gpu-wheels/hf-code/ (git-ignored); without it part p says skipped.
#
# Parts u and w (the user's path: a CogVLM checkout's own demo through finetune_cogvlm.sh at MP=2, two ranks sharing
# the card) read a CogVLM checkout: set COGVLM_CHECKOUT to a local clone of the public THUDM/CogVLM repository (or a
# fork) and its utils/ and finetune_demo/ are copied into .gpu-wheels/cogvlm/ (git-ignored, never committed);
# without it those parts say skipped. Its EVA imports xformers, which the machine lacks: sat_patches serves its
# stand-in once imported.
#
# sat_patches itself travels as the working tree (the command runs in the repository root): PYTHONPATH
# holds the root, and proof.py imports sat_patches before SAT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$ROOT/.gpu-wheels"
LIMIT=$((64 * 1024 * 1024))   # the device tool's carry limit: working tree plus carried paths

# name==version, one per line: what the proof imports beyond the machine's image (the kit's test reads this list):
# SAT, bitsandbytes, DeepSpeed's needs, sat_patches' own CAPTCHA drawing (captcha), and jsonlines, which a CogVLM
# checkout's utils/utils/dataset.py imports (parts u and w)
WHEELS=(
  SwissArmyTransformer==0.4.12
  bitsandbytes==0.50.2
  hjson==3.1.0
  pydantic==2.13.4
  pydantic_core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.5
  cpm_kernels==1.0.11
  tensorboardX==2.6.5
  webdataset==1.0.2
  braceexpand==0.1.7
  captcha==0.7.1
  jsonlines==4.0.0
)
DEEPSPEED=deepspeed==0.19.8
# parts p and h, installed apart (the image holds other versions of these; the kit's test reads this list):
# sat_patches.hf_recipes.PINS (bitsandbytes is in WHEELS) and the huggingface_hub transformers 4.41.2 needs
PEER_WHEELS=(
  transformers==4.41.2
  accelerate==0.30.1
  peft==0.11.1
  huggingface_hub==0.23.5
)
HF_CODE_FILES=(modeling_cogvlm.py visual.py configuration_cogvlm.py)

PYTHON="${PYTHON:-python3}"
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

mkdir -p "$DEST/peer"
rm -f "$DEST"/*.whl "$DEST"/peer/*.whl
rm -rf "$DEST/hf-code"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
echo "downloading ${#WHEELS[@]} wheels for CPython 3.12, manylinux x86_64, into $DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platform_args[@]}" -d "$DEST" "${WHEELS[@]}"

echo "downloading ${#PEER_WHEELS[@]} wheels for parts p and h into $DEST/peer"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platform_args[@]}" -d "$DEST/peer" "${PEER_WHEELS[@]}"
if [ -n "${HF_CODE:-}" ]; then
  mkdir -p "$DEST/hf-code"
  for f in "${HF_CODE_FILES[@]}"; do cp "$HF_CODE/$f" "$DEST/hf-code/" || { echo "HF_CODE=$HF_CODE lacks $f" >&2; exit 1; }; done
  echo "part p: the remote code from $HF_CODE copied into $DEST/hf-code"
else
  echo "part p will say skipped: set HF_CODE to a local copy of cogvlm-chat-hf's ${HF_CODE_FILES[*]}"
fi

rm -rf "$DEST/cogvlm"
if [ -n "${COGVLM_CHECKOUT:-}" ]; then
  for d in utils finetune_demo; do
    [ -d "$COGVLM_CHECKOUT/$d" ] || { echo "COGVLM_CHECKOUT=$COGVLM_CHECKOUT lacks $d/" >&2; exit 1; }
    mkdir -p "$DEST/cogvlm" && cp -r "$COGVLM_CHECKOUT/$d" "$DEST/cogvlm/"
  done
  echo "parts u and w: the checkout's utils/ and finetune_demo/ from $COGVLM_CHECKOUT copied into $DEST/cogvlm"
else
  echo "parts u and w will say skipped: set COGVLM_CHECKOUT to a local clone of THUDM/CogVLM"
fi

echo "building $DEEPSPEED as a pure-Python wheel (DS_BUILD_OPS=0)"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
"$PYTHON" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$build" "$DEEPSPEED"
(cd "$build" && DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" ./deepspeed-*.tar.gz)
ls "$DEST"/deepspeed-*-py3-none-any.whl >/dev/null

wheels=$(du -cb "$DEST" | tail -1 | cut -f1)
tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s += $1} END {print s + 0}')
total=$((wheels + tree))
"$PYTHON" -c 'import sys; w, t = (int(x) / 2**20 for x in sys.argv[1:]); print(f"wheels {w:.1f} MiB + working tree {t:.1f} MiB = {w + t:.1f} MiB (limit 64 MiB)")' "$wheels" "$tree"
if [ "$total" -ge "$LIMIT" ]; then
  echo "TOO LARGE for one device call: drop a wheel or ignore files" >&2
  exit 1
fi

cat <<'CALL'

The device call (tool `device`, verb `run`; leave `kind` out: one H100 is enough):
  carry: [".gpu-wheels"]
  timeout_s: 600
  command:
CALL
cat <<'COMMAND'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-wheels/*.whl || exit 3; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer .gpu-wheels/peer/*.whl || exit 3; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; df -h $PWD /tmp | tail -2; set -o pipefail; timeout 560 python3 benchmarks/gpu/proof.py --out $OUT --scratch $PWD --hf-code .gpu-wheels/hf-code --peer-site /tmp/peer --checkout .gpu-wheels/cogvlm 2>&1 | tee $OUT/proof.log
COMMAND
echo
echo "Afterwards: copy the table (proof.log's end) and proof.json's machine into BENCHMARKS.md's 'GPU proof kit'."
