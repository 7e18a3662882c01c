#!/usr/bin/env bash
# On the GPU machine, once receive.sh has every part: reassemble, verify, install, write env.sh.
#
#   bash bench/gpu/install.sh ENGINE        # vllm, sglang or lmpool
#
# The parts are joined into the pack's tar (checked against the sha256 that pack wrote), every
# wheel is checked against the pack's SHA256SUMS, and the wheels are installed with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-ENGINE ...
# into a folder of their own per engine (SGLang's pins differ from vLLM's; its transformers
# 5.12.1 and tokenizers 0.22.2 land there, ahead of the machine's on PYTHONPATH). It then writes
# /tmp/lmpool-gpu/ENGINE/env.sh, which run.sh sources:
#   PYTHONPATH=/tmp/site-ENGINE:/tmp/site-ENGINE/nvidia_cutlass_dsl/dsl_packages (Python reads no
#   .pth file in a --target folder, and cutlass-dsl finds its packages through one),
#   HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1.
# A second run with the same pack installed does nothing but write env.sh. PYTHON picks the
# interpreter (default python3: the machine's, with torch); LMGPU_TMP moves /tmp.
set -euo pipefail

engine=${1:?usage: install.sh ENGINE}
tmp=${LMGPU_TMP:-/tmp}
base=$tmp/lmpool-gpu/$engine
site=$tmp/site-$engine
python=${PYTHON:-python3}
started=$(date +%s)

if [[ ! -f $base/meta ]]; then
    echo "install: nothing received in $base: run receive.sh for every part first" >&2
    exit 2
fi
count=$(sed -n 's/^count=//p' "$base/meta")
tar_sha=$(sed -n 's/^tar_sha256=//p' "$base/meta")

if [[ -f $site/.lmpool-pack && $(cat "$site/.lmpool-pack") == "$tar_sha" ]]; then
    echo "install: $site already holds this pack"
else
    missing=""
    for ((i = 1; i <= count; i++)); do
        [[ -f $base/$(printf '%02d' "$i").part ]] || missing+=" $(printf '%02d' "$i")"
    done
    if [[ -n $missing ]]; then
        echo "install: parts$missing of $count missing in $base: send them with receive.sh" >&2
        exit 4
    fi
    parts=()
    for ((i = 1; i <= count; i++)); do parts+=("$base/$(printf '%02d' "$i").part"); done
    cat "${parts[@]}" >"$base/pack.tar"
    got=$(sha256sum "$base/pack.tar" | cut -d' ' -f1)
    if [[ $got != "$tar_sha" ]]; then
        echo "install: the joined tar's sha256 is $got, want $tar_sha: start again from part 01" >&2
        rm -f "$base/pack.tar"
        exit 5
    fi
    rm -f "${parts[@]}"
    rm -rf "$base/unpacked"
    mkdir -p "$base/unpacked"
    tar -xf "$base/pack.tar" -C "$base/unpacked"
    rm -f "$base/pack.tar"
    (cd "$base/unpacked" && sha256sum --check --quiet SHA256SUMS)
    n=$(find "$base/unpacked/wheels" -name '*.whl' | wc -l)
    echo "install: tar and $n wheels verified ($(($(date +%s) - started)) s); pip install --target $site"
    rm -rf "$site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        "$base/unpacked/wheels/"*.whl
    echo "$tar_sha" >"$site/.lmpool-pack"
    rm -rf "$base/unpacked"
    echo "install: $n wheels installed in $site ($(du -sh "$site" | cut -f1)," \
        "$(($(date +%s) - started)) s)"
fi

pythonpath=$site
[[ -d $site/nvidia_cutlass_dsl/dsl_packages ]] && pythonpath+=:$site/nvidia_cutlass_dsl/dsl_packages
cat >"$base/env.sh" <<EOF
# Written by bench/gpu/install.sh: source it before using the $engine pack.
export PYTHONPATH=$pythonpath\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$site/bin:\$PATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
EOF
echo "install: environment in $base/env.sh (run.sh sources it and puts the repo first):"
sed -n 's/^export /  /p' "$base/env.sh"
pth=$(find "$site" -maxdepth 1 -name '*.pth' -printf '%f ' 2>/dev/null || true)
[[ -z $pth ]] || echo "install: .pth files Python will not read from --target: $pth"
