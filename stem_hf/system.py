"""What the machine allows, checked before a long run rather than hours into it: the memory that can be had without
swapping (a container's cgroup limit included) and the free room on a filesystem, with `format_bytes` for the
messages. Standard library only."""

import os
import shutil

__all__ = ["available_memory", "check_disk_room", "format_bytes"]


def format_bytes(n: float) -> str:
    """`n` bytes for a message, in the decimal unit that fits: "512 B", "25.0 MB", "1.2 TB"."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 999.95:  # what rounds to 1000.0 shows as 1.0 of the next unit
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


def available_memory() -> int | None:
    """Bytes of memory that can be had without swapping: Linux's MemAvailable, or less where this process's cgroup
    (a container) is limited to less; None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            available = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None
    rooms = [room for room in (available, _cgroup_room()) if room is not None]
    return min(rooms) if rooms else None


def check_disk_room(path: str | os.PathLike, nbytes: int, what: str, detail: str = "") -> None:
    """Raises ("PATH: `what` 25.0 MB`detail` and ... has 10.0 MB free") where the filesystem `path` will be written on
    (that of its nearest existing folder) has less than `nbytes` free: files that fill as rows come would otherwise run
    out of room only hours in."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise OSError(f"{path}: {what} {format_bytes(nbytes)}{detail} and {folder} has {format_bytes(free)} free")


def _cgroup_paths() -> dict[str, str]:
    """This process's cgroup paths from /proc/self/cgroup: the v2 one under "", v1 ones under their controllers."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    paths[controller] = path
    except (OSError, ValueError):
        pass
    return paths


def _read_room(folder: str, limit_name: str, usage_name: str, inactive_key: str) -> int | None:
    """Limit less usage plus droppable page cache in one cgroup folder; None where it has no limit or no such files."""
    try:
        with open(os.path.join(folder, limit_name)) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, usage_name)) as f:
            usage = int(f.read().strip())
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split()[:2] for line in f if line.strip())
    except (OSError, ValueError):
        return None
    limits = [int(limit)] if limit != "max" else []
    if "hierarchical_memory_limit" in stat:  # v1: the tightest limit of this group and its ancestors
        limits.append(int(stat["hierarchical_memory_limit"]))
    limits = [n for n in limits if n < 2**60]  # v1 writes "no limit" as a huge number
    return max(0, min(limits) - usage + int(stat.get(inactive_key, 0))) if limits else None


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup memory limits leave: the limit less the usage, less page cache the kernel can drop
    (inactive file pages, as `docker stats` counts), at the tightest of its group and their ancestors (cgroup v2),
    else of its v1 memory group (or the root a container sees); None without a limit."""
    paths, rooms = _cgroup_paths(), []
    group = paths.get("", "/").strip("/")
    while True:  # v2: this group, then each ancestor up to the root
        rooms.append(_read_room(os.path.join(root, group), "memory.max", "memory.current", "inactive_file"))
        if not group:
            break
        group = os.path.dirname(group)
    v1 = paths.get("memory", "/").strip("/")
    for folder in dict.fromkeys([os.path.join(root, "memory", v1), os.path.join(root, "memory")]):
        if os.path.isdir(folder):
            rooms.append(_read_room(folder, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
            break
    rooms = [room for room in rooms if room is not None]
    return min(rooms) if rooms else None
