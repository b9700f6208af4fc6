#!/usr/bin/env bash
# The env with the libraries that write Hugging Face checkpoints, beside the main env:
# .tools/ckpt-ref, the poetry lock (dev group) plus torch (CPU), transformers 5,
# bitsandbytes, compressed-tensors, accelerate, PEFT and AutoAWQ's files, which are kept
# out of .venv. Sourced after scripts/bootstrap.sh by scripts/test-checkpoints (the
# fixtures' real-library checks) and scripts/run (--model smollm2-bnb: bitsandbytes
# quantizes SmolLM2's checkpoint). `ensure_ref_env` builds it once (a stamp of the pins
# and the lock) and sets $REF_VENV.

ensure_ref_env() {
  REF_VENV="$ROOT/.tools/ckpt-ref"
  # torch is not in poetry's lock: poetry would lock and install a multi-GB CUDA build.
  # 2.13.0 is the CPU wheel pip finds on this machine's disk (find-links); any other spec
  # pulls a CUDA build from the index, so pin it exactly.
  TORCH_PIN="torch==2.13.0"
  # The fixtures record these versions (reference.json's made_by) and are compared byte for
  # byte with what they write, so they are pinned exactly.
  REF_PINS="transformers==5.24.0 bitsandbytes==0.50.2 compressed-tensors==0.20.0 accelerate==1.15.0"
  # PEFT, for the adapter trained on a bnb-4bit base (tests/examples/test_hf_models_real.py).
  PEFT_PIN="peft==0.21.2"
  # Only two files of AutoAWQ are used (make_checkpoints.py: autoawq()); its declared
  # dependencies pull triton and a transformers 4 pin, so it goes in without them.
  AWQ_PIN="autoawq==0.2.9"

  # The stamp records the pins and the lock, so changing either rebuilds the env from
  # scratch; a half-done install leaves no stamp and is redone.
  STAMP="$TORCH_PIN $REF_PINS $PEFT_PIN $AWQ_PIN $(sha256sum "$ROOT/poetry.lock" | cut -d' ' -f1)"
  if [ "$(cat "$REF_VENV/.pins" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$REF_VENV"
    PY="$(find_python 3.11)" || { echo "ref-env: no Python 3.11 found" >&2; exit 1; }
    "$PY" -m venv "$REF_VENV"
    # poetry installs into the active VIRTUAL_ENV rather than .venv.
    VIRTUAL_ENV="$REF_VENV" CONDA_PREFIX= poetry_install --with dev

    # Everything poetry installed is pinned as a constraint, so pip may only add packages,
    # never upgrade or replace jax, numpy, safetensors, ...: a clash fails here instead.
    # Except two: transformers 5 needs tokenizers 0.23 and huggingface-hub >= 1.31, newer than
    # the lock's (the dev group's tokenizers, for KerasHub's tokenizer, which no test here uses).
    CONSTRAINTS="$REF_VENV/poetry-freeze.txt"
    "$REF_VENV/bin/python" -m pip freeze --disable-pip-version-check --exclude-editable \
      | grep -v -i -E '^(tokenizers|huggingface[-_]hub)==' >"$CONSTRAINTS"
    # shellcheck disable=SC2086
    "$REF_VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" \
      "$TORCH_PIN" $REF_PINS "$PEFT_PIN"
    "$REF_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$AWQ_PIN"
    echo "$STAMP" >"$REF_VENV/.pins"
  fi
}
