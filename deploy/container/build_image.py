"""Build the spikehound OCI image (``make image``) from Debian packages and this machine's pip; no registry.

Two images, each tagged with a hash of its inputs and built only when no image has that tag yet:

* ``localhost/spikehound-base:HASH``: a Debian minbase root made by debootstrap, with Python 3, from the
  mirror that this machine's own apt sources name (``/etc/apt/sources.list``, ``sources.list.d/``), updated
  from the security and updates suites found there;
* ``localhost/spikehound:HASH`` (also tagged ``latest`` and with the version): ``Containerfile`` on that base, a virtual
  environment holding spikehound's wheel (``python -m build``) and the wheels of its dependencies, which
  this machine's pip downloads as it is configured (index, mirrors, constraints), for the base's Python.

The last line printed is the image's name. Exit status 3: the image cannot be built on this machine (buildah
or debootstrap missing, no Debian mirror configured or reachable, pip unable to fetch the dependencies'
wheels); the message says which.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORK = ROOT / "build" / "image"  # wheels and build contexts; build/ is ignored by git
IMAGE = "localhost/spikehound"
BASE_IMAGE = "localhost/spikehound-base"
# Debian packages of the base. python3-venv brings ensurepip, which makes the image's virtual environment.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Trimmed from the base: documentation, manuals, translations and apt's caches are no use in a daemon's image.
BASE_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/cache/apt",
             "var/lib/apt/lists", "var/log")
# What the image is made of besides the base: the package's sources and this folder.
SOURCE_INPUTS = ("pyproject.toml", "README.md", "spikehound")
MISSING = 3


class CannotBuild(Exception):
    """A missing tool or mirror: the image cannot be built on this machine."""


def log(message: str) -> None:
    print(f"build_image: {message}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, capture: bool = False, cwd: Path | None = None) -> str:
    result = subprocess.run(list(argv), check=False, cwd=cwd, text=True,
                            stdout=subprocess.PIPE if capture else None)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, list(argv), result.stdout)
    return result.stdout.strip() if capture else ""


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise CannotBuild(f"{', '.join(missing)} not found: apt-get install {' '.join(missing)}")


def image_exists(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True,
                          check=False).returncode == 0


# --- the Debian mirror, from this machine's apt sources ------------------------------------------------------

def apt_entries(etc: Path = Path("/etc/apt")) -> Iterator[tuple[str, str, list[str]]]:
    """(URI, suite, components) of every enabled ``deb`` source, one-line and deb822 formats both."""
    files = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]
    for path in files:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
            if len(words) >= 3 and words[0] == "deb":
                yield words[1], words[2], words[3:]
    for path in sorted((etc / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
                continue
            for uri in fields.get("uris", "").split():
                for suite in fields.get("suites", "").split():
                    yield uri, suite, fields.get("components", "").split()


def host_suite() -> str:
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    if fields.get("ID") != "debian" or not fields.get("VERSION_CODENAME"):
        raise CannotBuild("the base is built from this machine's Debian mirror: pass --suite (a Debian release "
                          "that the configured apt sources serve)")
    return fields["VERSION_CODENAME"].strip('"')


def mirror_lines(suite: str) -> list[str]:
    """``deb URI SUITE main`` lines for the suite, its updates and its security suite, as apt sources name them."""
    entries = [(uri, s) for uri, s, components in apt_entries() if "main" in components]
    main = next((uri for uri, s in entries if s == suite), None)
    if main is None:
        raise CannotBuild(f"no apt source serves Debian {suite} (main) in /etc/apt/sources.list or "
                          "/etc/apt/sources.list.d/: the base root is fetched from it")
    lines = [f"deb {main} {suite} main"]
    for extra in (f"{suite}-updates", f"{suite}-security"):
        lines += [f"deb {uri} {s} main" for uri, s in entries if s == extra][:1]
    return lines


# --- hashes of the inputs ------------------------------------------------------------------------------------

def source_files() -> list[Path]:
    """The files that go into the wheel and the image, as git lists them (tracked or new, not ignored)."""
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", *SOURCE_INPUTS],
                 capture=True, cwd=ROOT)
    names = sorted({n for n in listed.split("\0") if n and (ROOT / n).is_file()})
    return [ROOT / n for n in names] + sorted(p for p in HERE.iterdir() if p.is_file())


def digest(parts: Sequence[str | bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:16]


def base_tag(suite: str) -> str:
    return f"{BASE_IMAGE}:{digest([suite, platform.machine(), *BASE_PACKAGES, *BASE_TRIM, 'v1'])}"


def image_tag(base: str) -> str:
    parts: list[str | bytes] = [base]
    for path in source_files():
        parts += [str(path.relative_to(ROOT)), path.read_bytes()]
    return f"{IMAGE}:{digest(parts)}"


# --- the two builds ------------------------------------------------------------------------------------------

def build_base(tag: str, suite: str) -> None:
    need("debootstrap")
    lines = mirror_lines(suite)
    mirror = lines[0].split()[1]
    log(f"base {tag}: debootstrap --variant=minbase {suite} from the mirror of this machine's apt sources")
    container = run(["buildah", "from", "scratch"], capture=True)
    try:
        root = Path(run(["buildah", "mount", container], capture=True))
        try:
            run(["debootstrap", "--variant=minbase", "--components=main", f"--include={','.join(BASE_PACKAGES)}",
                 suite, str(root), mirror])
        except subprocess.CalledProcessError as exc:
            raise CannotBuild(f"debootstrap could not make a {suite} root from {mirror} (exit {exc.returncode}; "
                              "its log is above)") from exc
        (root / "etc/apt/sources.list").write_text("\n".join(lines) + "\n")
        # Security and point-release fixes published since the release.
        run(["chroot", str(root), "sh", "-c", "apt-get update -q && DEBIAN_FRONTEND=noninteractive "
             "apt-get -y -q upgrade && apt-get clean"])
        for part in BASE_TRIM:
            shutil.rmtree(root / part, ignore_errors=True)
            (root / part).mkdir(parents=True, exist_ok=True)
        run(["buildah", "umount", container])
        run(["buildah", "config", "--created-by", "deploy/container/build_image.py", container])
        run(["buildah", "commit", "--rm", container, tag])
    except BaseException:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
        raise


def base_python(base: str) -> tuple[str, str]:
    """The base's Python version ("3.11") and glibc version ("2.36"), which its wheels must fit."""
    container = run(["buildah", "from", base], capture=True)
    try:
        out = run(["buildah", "run", "--isolation", "chroot", container, "--", "python3", "-c",
                   "import platform, sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}', "
                   "platform.libc_ver()[1])"], capture=True)
    finally:
        run(["buildah", "rm", container], capture=True)
    version, glibc = out.split()
    return version, glibc


def wheels(into: Path, python: str, glibc: str) -> tuple[str, str]:
    """spikehound's wheel (built from a copy of its sources) in ``wheel/``, and its dependencies' wheels for the
    base in ``dependencies/``; the hash of each set."""
    own, deps = into / "wheel", into / "dependencies"
    own.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="spikehound-src-") as src:
        for path in source_files():
            if path.parent != HERE:
                target = Path(src) / path.relative_to(ROOT)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
        run([sys.executable, "-m", "build", "--wheel", "--outdir", str(own), src], capture=True)
    (wheel,) = own.glob("spikehound-*.whl")
    # The dependencies' wheels are kept while pyproject.toml's dependencies and the base's Python stay the same.
    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    cached = WORK / f"dependencies-{digest([python, glibc, *sorted(wanted)])}"
    if not cached.is_dir():
        download_dependencies(wheel, cached, python, glibc)
    shutil.copytree(cached, deps)
    return (digest(sorted(p.name for p in deps.iterdir())),
            digest([wheel.read_bytes()]))


def download_dependencies(wheel: Path, into: Path, python: str, glibc: str) -> None:
    """The wheels of ``wheel``'s dependencies for the base's Python and glibc, as this machine's pip finds them."""
    shutil.rmtree(into, ignore_errors=True)
    partial = into.with_name(into.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    major, minor = glibc.split(".")[:2]
    tag = python.replace(".", "")
    # Every manylinux tag that the base's glibc runs (pip does not widen a --platform by itself).
    arch = platform.machine()
    platforms = [f"manylinux_{major}_{m}_{arch}" for m in range(int(minor), 4, -1)]
    platforms += [f"{legacy}_{arch}" for legacy in ("manylinux2014", "manylinux2010", "manylinux1")]
    try:
        run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(partial), "--only-binary=:all:",
             "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3",
             "--abi", "none", *(f"--platform={p}" for p in platforms), str(wheel)])
    except subprocess.CalledProcessError as exc:
        raise CannotBuild(f"pip could not download the wheels of spikehound's dependencies for Python {python} "
                          f"(exit {exc.returncode}; its message is above)") from exc
    (partial / wheel.name).unlink()
    partial.rename(into)


def build_image(tag: str, base: str) -> None:
    python, glibc = base_python(base)
    log(f"image {tag}: spikehound and its dependencies for Python {python} (glibc {glibc}) on {base}")
    context = WORK / tag.rsplit(":", 1)[1]
    shutil.rmtree(context, ignore_errors=True)
    dependencies, own = wheels(context, python, glibc)
    shutil.copy2(HERE / "healthcheck.py", context / "healthcheck.py")
    # --layers: the dependencies' layer is cached, and reused while their wheels stay the same.
    run(["buildah", "bud", "--quiet", "--layers", "--format", "docker", "--isolation", "chroot",
         "--build-arg", f"BASE={base}", "--build-arg", f"DEPENDENCIES={dependencies}",
         "--build-arg", f"SPIKEHOUND={own}", "--file", str(HERE / "Containerfile"), "--tag", tag, str(context)],
        capture=True)
    shutil.rmtree(context, ignore_errors=True)


def forget_older(tag: str) -> None:
    """Remove the images of earlier inputs (each holds a few hundred MB); one still in use stays."""
    listed = run(["buildah", "images", "--noheading", "--format", "{{.Name}}:{{.Tag}}"], capture=True)
    for name in listed.split():
        if name != tag and re.fullmatch(re.escape(IMAGE) + r":[0-9a-f]{16}", name):
            subprocess.run(["buildah", "rmi", name], capture_output=True, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", help="Debian release of the base (default: this machine's)")
    parser.add_argument("--print-tag", action="store_true", help="print the image's name and build nothing")
    args = parser.parse_args(argv)
    try:
        need("buildah", "git")
        suite = args.suite or host_suite()
        base = base_tag(suite)
        tag = image_tag(base)
        if args.print_tag:
            print(tag)
            return 0
        WORK.mkdir(parents=True, exist_ok=True)
        lock = (WORK / ".lock").open("w")  # one build at a time: a second caller waits, then finds the image
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.monotonic()
        if image_exists(tag):
            log(f"{tag} exists (same inputs): nothing to build")
        else:
            if image_exists(base):
                log(f"{base} exists: the base is reused")
            else:
                build_base(base, suite)
            build_image(tag, base)
            log(f"built in {time.monotonic() - started:.0f} s")
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        run(["buildah", "tag", tag, f"{IMAGE}:latest", f"{IMAGE}:{version}"])
        forget_older(tag)
    except CannotBuild as exc:
        log(f"cannot build the image: {exc}")
        return MISSING
    except subprocess.CalledProcessError as exc:
        if exc.output:
            print(exc.output[-4000:], file=sys.stderr)
        log(f"failed ({exc.returncode}): {' '.join(map(str, exc.cmd))}")
        return 1
    print(tag)
    return 0


if __name__ == "__main__":
    os.umask(0o022)  # the image's files are readable by its non-root user whatever the caller's umask
    sys.exit(main())
