#!/usr/bin/env bash
# On the GPU machine: append one carried part of a pack under /tmp/lmpool-gpu/ENGINE.
#
#   bash bench/gpu/receive.sh ENGINE PART_DIR      # PART_DIR: .gpu/ENGINE/parts/NN, carried
#
# Part 01 starts afresh (it clears /tmp/lmpool-gpu/ENGINE). A later part is refused, with exit
# status 4, when an earlier one of the same pack is not there: the machine was given back between
# two calls (it keeps /tmp only ~30 s after a call), so start again from part 01. A part whose
# checksum is off (exit 3) broke in transfer: send that part again. LMGPU_TMP moves /tmp
# (a local rehearsal of the whole sequence).
set -euo pipefail

engine=${1:?usage: receive.sh ENGINE PART_DIR}
part_dir=${2:?usage: receive.sh ENGINE PART_DIR}
base=${LMGPU_TMP:-/tmp}/lmpool-gpu/$engine

if [[ ! -f $part_dir/part || ! -f $part_dir/meta ]]; then
    echo "receive: no part and meta in $part_dir: name that folder in the call's carry" >&2
    exit 2
fi
meta() { sed -n "s/^$1=//p" "$part_dir/meta"; }
if [[ $(meta engine) != "$engine" ]]; then
    echo "receive: $part_dir belongs to the $(meta engine) pack, not $engine" >&2
    exit 2
fi
index=$(meta index)
count=$(meta count)
tar_sha=$(meta tar_sha256)
name=$(printf '%02d' "$index")

got=$(sha256sum "$part_dir/part" | cut -d' ' -f1)
if [[ $got != "$(meta part_sha256)" ]]; then
    echo "receive: part $name/$count: sha256 $got, want $(meta part_sha256): send it again" >&2
    exit 3
fi

if ((index == 1)); then
    rm -rf "$base"
    mkdir -p "$base"
    echo "$tar_sha" >"$base/tar.sha256"
fi
if [[ ! -f $base/tar.sha256 || $(cat "$base/tar.sha256") != "$tar_sha" ]]; then
    echo "receive: $base holds no earlier part of this pack (the machine was given back" \
        "between calls, or the pack was remade): start again from part 01" >&2
    exit 4
fi
missing=""
for ((i = 1; i < index; i++)); do
    [[ -f $base/$(printf '%02d' "$i").part ]] || missing+=" $(printf '%02d' "$i")"
done
if [[ -n $missing ]]; then
    echo "receive: parts$missing of $engine are not in $base: send them first" \
        "(or start again from part 01)" >&2
    exit 4
fi

cp "$part_dir/part" "$base/$name.part.tmp"
mv "$base/$name.part.tmp" "$base/$name.part"
cp "$part_dir/meta" "$base/meta"
have=$(find "$base" -maxdepth 1 -name '??.part' | wc -l)
free=$(df -h "$base" | awk 'NR==2 {print $4}')
echo "receive: $engine part $name/$count ok ($(meta part_bytes) bytes); $have of $count in $base;" \
    "$free free"
if ((have == count)); then
    echo "receive: all $count parts in: next, bash bench/gpu/install.sh $engine"
fi
