"""Retag the cross-built llama-cpp-python wheel for aarch64 (make arm64-check).

    python tools/arm64/retag_wheel.py BUILT.whl WHEELHOUSE

pip names a wheel after the machine that ran the build (``linux_x86_64``) even when CMake's
toolchain compiled it for another one. This checks that every shared library in BUILT.whl is an
aarch64 ELF file (e_machine 183) and refuses the wheel otherwise, then writes it into WHEELHOUSE
retagged ``linux_aarch64`` (``wheel tags``, which also rewrites the WHEEL file and the RECORD).
Prints the new wheel's path.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

EM_AARCH64 = 183
PLATFORM_TAG = "linux_aarch64"


def elf_machine(head: bytes) -> int | None:
    """e_machine of an ELF header (None when ``head`` is not one)."""
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    endian = "<" if head[5] == 1 else ">"
    return struct.unpack_from(endian + "H", head, 18)[0]


def check_aarch64(wheel: Path) -> list[str]:
    """Names of the wheel's shared libraries; raises SystemExit when one is not aarch64."""
    libs, wrong = [], []
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if ".so" not in Path(name).name:
                continue
            with zf.open(name) as f:
                machine = elf_machine(f.read(64))
            if machine is None:
                continue
            libs.append(name)
            if machine != EM_AARCH64:
                wrong.append(f"{name} (e_machine {machine})")
    if not libs:
        raise SystemExit(f"{wheel}: no shared library in the wheel")
    if wrong:
        raise SystemExit(f"{wheel}: not aarch64: {', '.join(wrong)}")
    return libs


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    built, wheelhouse = Path(argv[0]), Path(argv[1])
    libs = check_aarch64(built)
    wheelhouse.mkdir(parents=True, exist_ok=True)
    for old in wheelhouse.glob(built.name.split("-")[0] + "-*.whl"):
        old.unlink()
    copy = wheelhouse / built.name
    shutil.copy2(built, copy)
    out = subprocess.run(
        [sys.executable, "-m", "wheel", "tags", "--platform-tag", PLATFORM_TAG, "--remove", str(copy)],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    if not out:
        raise SystemExit("wheel tags printed no file name")
    new = wheelhouse / Path(out[-1]).name
    if not new.exists() or not new.name.endswith(f"-{PLATFORM_TAG}.whl"):
        raise SystemExit(f"retagged wheel not found: {new}")
    names = sorted({Path(n).name.split(".so")[0] for n in libs})
    print(f"{new} (aarch64: {', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
