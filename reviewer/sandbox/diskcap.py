"""A hard cap on a workspace's disk use, enforced by the kernel: the workspace folder becomes the mount point of its own
small ext4 file system, kept in a sparse image file beside it and mounted through a loop device. A write past the cap
fails with "No space left on device" however fast the writer is, which the supervisor's polling (supervisor.DiskWatch)
cannot promise: under load a disk-filling repository got 144-355 MiB past a 100 MiB allowance between two polls, and
up to 4.4 GB in a review. The polling stays, as the second line and for the event it records.

Why a loop-mounted ext4: a tmpfs with a size would hold the workspace in memory (a 10 GiB allowance is 10 GiB of RAM or
swap), and a project quota needs a file system mounted with prjquota, which the machine's own disk usually is not.
Mounting needs root (CAP_SYS_ADMIN) and a loop device; without them `mount_capped` says why and the workspace is a
plain folder, limited by polling alone, as before. Checked here: as root on ext4, mkfs of a sparse 10 GiB image takes
~0.1 s, and bubblewrap's --bind carries the mount into the sandbox.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

MiB = 1024 * 1024
# ext4 without a journal keeps ~2% of a file system for inode tables and bitmaps; the image is that much larger than
# the allowance, plus a little, so the allowance itself is usable (and the polling limit, which records the event,
# normally bites first). The kernel's cap is therefore at most MARGIN past disk_bytes.
OVERHEAD_FRACTION = 0.04
MARGIN_BYTES = 16 * MiB
TOOL_TIMEOUT = 60


def image_path(path: Path) -> Path:
    return path.with_name(path.name + ".img")


def image_size(disk_bytes: int) -> int:
    size = int(disk_bytes * (1 + OVERHEAD_FRACTION)) + MARGIN_BYTES
    return (size + 4095) // 4096 * 4096


def host_folder(path: Path) -> Path:
    """Where a workspace's bytes land on the host: the folder holding its image when it is capped, else itself."""
    return path.parent if image_path(path).exists() and os.path.ismount(path) else path


def unavailable_reason() -> str | None:
    """Why this machine cannot cap a workspace's disk use in the kernel (None: it can)."""
    if os.geteuid() != 0:
        return "mounting a size-limited file system needs root; the disk limit is enforced by polling only"
    for tool in ("mkfs.ext4", "mount", "umount"):
        if not shutil.which(tool):
            return f"{tool} is not installed (e2fsprogs / util-linux); the disk limit is enforced by polling only"
    if not os.path.exists("/dev/loop-control") and not os.path.exists("/dev/loop0"):
        return "no loop devices (/dev/loop-control); the disk limit is enforced by polling only"
    return None


def _run(argv: list[str]) -> str | None:
    """None on success, else the tool's last line of complaint."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]}: {e}"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return f"{argv[0]}: {lines[-1] if lines else f'exit {proc.returncode}'}"


def mount_capped(path: Path, disk_bytes: int) -> str | None:
    """Make the empty folder `path` a file system that holds at most about `disk_bytes` (plus MARGIN_BYTES). Returns
    None when it is mounted, else why not (the folder is then left as it was: a plain folder)."""
    why = unavailable_reason()
    if why:
        return why
    image = image_path(path)
    try:
        with open(image, "wb") as f:
            f.truncate(image_size(disk_bytes))  # sparse: the host's disk holds only what is written
    except OSError as e:
        return f"cannot create {image}: {e.strerror or e}"
    # -m 0: no blocks reserved for root (the sandbox runs as root in its namespace when the reviewer does); no journal:
    # the image is scratch, thrown away after the persona, and a journal would cost 4-128 MiB of the allowance.
    why = (_run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard",
                 str(image)])
           or _run(["mount", "-o", "loop,nosuid,nodev,noatime", str(image), str(path)]))
    if why:
        image.unlink(missing_ok=True)
        return why
    (path / "lost+found").rmdir()  # mkfs's folder for fsck: noise in the workspace
    return None


def release(path: Path) -> None:
    """Unmount `path` if it is a capped workspace and delete its image (a no-op for a plain folder). A busy mount (a
    process still inside) is detached lazily: the kernel frees it when the last user is gone."""
    if os.path.ismount(path):
        if _run(["umount", str(path)]) is not None:
            _run(["umount", "-l", str(path)])
    image_path(path).unlink(missing_ok=True)
