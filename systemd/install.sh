#!/usr/bin/env bash
# Installs kvmmd as a systemd service, or removes it again.
#
#   systemd/install.sh [install|uninstall] [--destdir DIR] [--prefix /usr] [--sysconfdir /etc]
#                      [--no-build] [--bindir-from DIR] [--systemd-version N] [--python-dir DIR] [--purge]
#
# install (the default) builds the release binaries and the client library with
# `cargo build --release --locked -p kvmm-daemon -p kvmm-ctl -p kvmm-capi` when they are missing or
# older than the sources (the release profile is fat LTO: minutes, not seconds; build as yourself
# first, then run this with sudo), then installs:
#
#   $prefix/bin/kvmmd, $prefix/bin/kvmmctl                          0755
#   $prefix/lib/libkvmm.so                                          0755, the C API (capi/)
#   $prefix/lib/libkvmm.a                                           0644, the same, to link statically
#   $prefix/include/kvmm.h, $prefix/lib/pkgconfig/kvmm{,-static}.pc 0644
#   PYTHONDIR/kvmm.py                                               0644, the Python binding
#   $prefix/lib/systemd/system/kvmmd{,-fd,-admin}.socket, kvmmd.service 0644
#   $prefix/lib/systemd/system/kvmmd.service.d/50-systemd-254.conf  0644, only for systemd >= 254
#   $prefix/lib/sysusers.d/kvmm.conf                                0644
#   $prefix/share/doc/kvmm/{kvmmd.toml.example,README.md}           0644
#   $sysconfdir/kvmm/kvmmd.toml                                     0644, only if absent: the example
#                                                                   with admin_group = "kvmm-admin"
#
# Paths the units name (/usr/bin/kvmmd, /etc/kvmm/kvmmd.toml, /usr/share/doc/kvmm) follow --prefix
# and --sysconfdir. As root on a host where systemd is PID 1 and without --destdir, it then creates
# the user and groups (systemd-sysusers) and reloads systemd; otherwise it prints those commands.
# As root without --destdir it runs ldconfig for the library. PYTHONDIR is --python-dir, else the
# first directory the python3 on PATH imports packages from under $prefix/lib/ (Debian's python3:
# /usr/lib/python3/dist-packages for /usr); without either the module is left out, and said so.
#
# uninstall stops and disables the units (same conditions), removes every file listed above and
# leaves $sysconfdir/kvmm/kvmmd.toml and /var/lib/kvmm (the flash file) unless --purge. The user
# kvmm and the groups kvmm-clients and kvmm-admin stay: removing system users is the distribution's
# call.
#
# --destdir DIR        stage everything under DIR (packaging, tests); touches nothing else
# --no-build           never run cargo; install the binaries that are there
# --bindir-from DIR    take kvmmd, kvmmctl, libkvmm.so and libkvmm.a from DIR (also $KVMM_BIN_DIR) instead of
#                      ${CARGO_TARGET_DIR:-target}/release; implies --no-build
# --systemd-version N  decide about the systemd 254 drop-in for N instead of `systemctl --version`
# --python-dir DIR     install the Python module kvmm.py into DIR (`none`: leave it out)
# --purge              uninstall: remove the configuration and /var/lib/kvmm too
#
# Running either action twice is harmless. Exit status: 0 done, 1 failed, 2 usage error.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

say() { printf 'install.sh: %s\n' "$*"; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }
usage() {
  printf 'install.sh: %s\n' "$*" >&2
  sed -n '4,5p' "${BASH_SOURCE[0]}" | sed 's/^#   //;1s/^/usage: /;2s/^/       /' >&2
  exit 2
}

action=install
destdir=""
prefix=/usr
sysconfdir=/etc
build=yes
bin_from="${KVMM_BIN_DIR:-}"
systemd_version=""
python_dir="" # --python-dir; empty: ask python3
purge=no
tmp="" # scratch directory of do_install, removed on exit

while [[ $# -gt 0 ]]; do
  case "$1" in
    install | uninstall) action="$1" ;;
    --destdir | --prefix | --sysconfdir | --bindir-from | --systemd-version | --python-dir)
      [[ $# -ge 2 && -n "$2" ]] || usage "$1 needs a value"
      case "$1" in
        --destdir) destdir="$2" ;;
        --prefix) prefix="$2" ;;
        --sysconfdir) sysconfdir="$2" ;;
        --bindir-from) bin_from="$2" ;;
        --systemd-version) systemd_version="$2" ;;
        --python-dir) python_dir="$2" ;;
      esac
      shift
      ;;
    --no-build) build=no ;;
    --purge) purge=yes ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d;s/^# \{0,1\}//'
      exit 0
      ;;
    *) usage "unknown argument '$1'" ;;
  esac
  shift
done

[[ "$prefix" == /* ]] || usage "--prefix must be an absolute path, not '$prefix'"
[[ "$sysconfdir" == /* ]] || usage "--sysconfdir must be an absolute path, not '$sysconfdir'"
[[ -z "$systemd_version" || "$systemd_version" =~ ^[0-9]+$ ]] ||
  usage "--systemd-version takes a number such as 254, not '$systemd_version'"
[[ "$purge" == no || "$action" == uninstall ]] || usage "--purge only applies to uninstall"
[[ -z "$python_dir" || "$python_dir" == none || "$python_dir" == /* ]] ||
  usage "--python-dir must be an absolute path or 'none', not '$python_dir'"
prefix="${prefix%/}"
sysconfdir="${sysconfdir%/}"
if [[ -n "$destdir" ]]; then
  mkdir -p "$destdir" || die "cannot create the staging directory $destdir"
  destdir="$(cd "$destdir" && pwd)"
fi
if [[ -z "$destdir" && "$EUID" -ne 0 ]]; then
  die "$action into $prefix and $sysconfdir needs root: run it with sudo, or stage with --destdir DIR"
fi

# systemd manages services here only when it is PID 1 and we are not staging.
live_systemd=no
if [[ -z "$destdir" && -d /run/systemd/system ]]; then
  live_systemd=yes
fi

unitdir="$prefix/lib/systemd/system"
dropindir="$unitdir/kvmmd.service.d"
dropin="$dropindir/50-systemd-254.conf"
sysusers="$prefix/lib/sysusers.d/kvmm.conf"
docdir="$prefix/share/doc/kvmm"
library="$prefix/lib/libkvmm.so"
header="$prefix/include/kvmm.h"
pkgconfig="$prefix/lib/pkgconfig/kvmm.pc"
pkgconfig_static="$prefix/lib/pkgconfig/kvmm-static.pc"
static_library="$prefix/lib/libkvmm.a"
# What libkvmm.a needs from the system (`rustc --print native-static-libs` for kvmm-capi).
native_static_libs="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"

# The first directory the python3 on PATH imports packages from under $prefix/lib/; empty if none.
python_site() {
  command -v python3 >/dev/null 2>&1 || return 0
  python3 - "$prefix/lib/" <<'PY' 2>/dev/null || true
import site, sys
print(next((d for d in site.getsitepackages() if d.startswith(sys.argv[1])), ""))
PY
}

case "$python_dir" in
  none) python_dir="" ;;
  "") python_dir="$(python_site)" ;;
esac
python_dir="${python_dir%/}"
python_module="${python_dir:+$python_dir/kvmm.py}"
confdir="$sysconfdir/kvmm"
config="$confdir/kvmmd.toml"
statedir=/var/lib/kvmm
units=(kvmmd.socket kvmmd-fd.socket kvmmd-admin.socket kvmmd.service)
next_steps=(
  "systemctl enable --now kvmmd.socket kvmmd-fd.socket kvmmd-admin.socket kvmmd.service"
  "usermod -aG kvmm-clients USER    # and kvmm-admin for operators; they log in again"
)

# Every file install puts in place (without $destdir), so uninstall removes exactly those.
installed_files() {
  printf '%s\n' "$prefix/bin/kvmmd" "$prefix/bin/kvmmctl" "$library" "$static_library" "$header" \
    "$pkgconfig" "$pkgconfig_static"
  [[ -z "$python_module" ]] || printf '%s\n' "$python_module"
  local unit
  for unit in "${units[@]}"; do printf '%s\n' "$unitdir/$unit"; done
  printf '%s\n' "$dropin" "$sysusers" "$docdir/kvmmd.toml.example" "$docdir/README.md"
}

# The units with the paths they name moved to --prefix and --sysconfdir.
rewrite_paths() {
  sed -e "s|/usr/bin/kvmmd|$prefix/bin/kvmmd|g" \
    -e "s|/usr/share/doc/kvmm/|$docdir/|g" \
    -e "s|/etc/kvmm/kvmmd.toml|$config|g" "$1"
}

host_systemd_version() {
  local v
  command -v systemctl >/dev/null 2>&1 || return 0
  v="$(systemctl --version 2>/dev/null | awk 'NR == 1 { print $2 }')" || return 0
  printf '%s' "${v%%[^0-9]*}"
}

# What install takes from the build directory, and the command that builds it.
built=(kvmmd kvmmctl libkvmm.so libkvmm.a)
cargo_build="cargo build --release --locked -p kvmm-daemon -p kvmm-ctl -p kvmm-capi"

build_binaries() {
  local bindir="$1" stale="" bin
  for bin in "${built[@]}"; do
    if [[ ! -f "$bindir/$bin" ]]; then
      stale="$bindir/$bin is missing"
      break
    fi
    if [[ -n "$(find "$repo" \( -path "$repo/target" -o -path "$repo/.git" -o -path "$repo/fuzz" \) -prune \
      -o \( -name '*.rs' -o -name '*.proto' -o -name Cargo.toml -o -name Cargo.lock \) \
      -newer "$bindir/$bin" -print -quit)" ]]; then
      stale="$bindir/$bin is older than the sources"
      break
    fi
  done
  if [[ -z "$stale" ]]; then
    say "the release binaries in $bindir are up to date; not building"
    return
  fi
  command -v cargo >/dev/null 2>&1 ||
    die "$stale and cargo is not on PATH (sudo resets it): build first as yourself with \`$cargo_build\`, then run this again (or pass --no-build)"
  say "$stale; building with cargo (release profile, fat LTO: this takes minutes)"
  (cd "$repo" && $cargo_build) ||
    die "cargo build failed; nothing was installed"
}

do_install() {
  local bindir version
  if [[ -n "$bin_from" ]]; then
    bindir="$bin_from"
  else
    bindir="${CARGO_TARGET_DIR:-$repo/target}/release"
    [[ "$build" == no ]] || build_binaries "$bindir"
  fi
  local bin
  for bin in "${built[@]}"; do
    [[ "$bin" == *.a || -x "$bindir/$bin" ]] ||
      die "$bindir/$bin is not an executable: build it ($cargo_build) or name its directory with --bindir-from"
    [[ -f "$bindir/$bin" ]] ||
      die "$bindir/$bin is missing: build it ($cargo_build) or name its directory with --bindir-from"
  done
  local f
  for f in capi/include/kvmm.h capi/python/kvmm.py; do
    [[ -f "$repo/$f" ]] || die "$repo/$f is missing: run this script from a kvmm checkout"
  done
  local release
  release="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | head -n 1)"
  [[ -n "$release" ]] || die "no version line in $repo/Cargo.toml"
  for f in "${units[@]}" kvmm.sysusers kvmmd.toml.example kvmmd.service.d/50-systemd-254.conf; do
    [[ -f "$here/$f" ]] || die "$here/$f is missing: run this script from a kvmm checkout"
  done

  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT

  install -D -m 0755 "$bindir/kvmmd" "$destdir$prefix/bin/kvmmd"
  install -D -m 0755 "$bindir/kvmmctl" "$destdir$prefix/bin/kvmmctl"
  for unit in "${units[@]}"; do
    rewrite_paths "$here/$unit" >"$tmp/$unit"
    install -D -m 0644 "$tmp/$unit" "$destdir$unitdir/$unit"
  done
  say "installed kvmmd and kvmmctl to $destdir$prefix/bin and the units to $destdir$unitdir"

  install -D -m 0755 "$bindir/libkvmm.so" "$destdir$library"
  install -D -m 0644 "$repo/capi/include/kvmm.h" "$destdir$header"
  cat >"$tmp/kvmm.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: kvmm
Description: C API of the kvmm client library (sessions of kvmmd, the KV-cache memory daemon)
Version: $release
Libs: -L\${libdir} -lkvmm
Cflags: -I\${includedir}
PC
  install -D -m 0644 "$tmp/kvmm.pc" "$destdir$pkgconfig"
  # The static library holds the Rust standard library too; what that needs from the system is
  # what rustc prints with --print native-static-libs for a staticlib on linux-gnu.
  install -D -m 0644 "$bindir/libkvmm.a" "$destdir$static_library"
  cat >"$tmp/kvmm-static.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: kvmm-static
Description: C API of the kvmm client library, linked statically (libkvmm.a)
Version: $release
Libs: -L\${libdir} -l:libkvmm.a $native_static_libs
Cflags: -I\${includedir}
PC
  install -D -m 0644 "$tmp/kvmm-static.pc" "$destdir$pkgconfig_static"
  say "installed the C API: $destdir$library, $destdir$static_library, $destdir$header, $destdir$pkgconfig and $destdir$pkgconfig_static"
  if [[ -z "$destdir" && "$EUID" -eq 0 ]]; then
    ldconfig || say "ldconfig failed; programs may not find $library until it runs"
  fi
  if [[ -n "$python_module" ]]; then
    install -D -m 0644 "$repo/capi/python/kvmm.py" "$destdir$python_module"
    say "installed the Python binding: $destdir$python_module"
  else
    say "no python3 here imports packages from under $prefix/lib/: left out the Python binding (--python-dir DIR installs capi/python/kvmm.py there)"
  fi

  version="${systemd_version:-$(host_systemd_version)}"
  if [[ -z "$version" ]]; then
    rm -f "$destdir$dropin"
    say "no systemctl here and no --systemd-version: left out the systemd 254 drop-in"
  elif ((version >= 254)); then
    install -D -m 0644 "$here/kvmmd.service.d/50-systemd-254.conf" "$destdir$dropin"
    say "systemd $version${systemd_version:+ (--systemd-version)}: installed the drop-in $destdir$dropin (Type=notify-reload, MemoryPressureWatch=auto)"
  else
    rm -f "$destdir$dropin"
    rmdir "$destdir$dropindir" 2>/dev/null || true
    say "systemd $version${systemd_version:+ (--systemd-version)} is older than 254: left out the drop-in 50-systemd-254.conf"
  fi

  install -D -m 0644 "$here/kvmm.sysusers" "$destdir$sysusers"
  install -D -m 0644 "$here/kvmmd.toml.example" "$destdir$docdir/kvmmd.toml.example"
  install -D -m 0644 "$repo/README.md" "$destdir$docdir/README.md"
  say "installed $destdir$sysusers and the documentation to $destdir$docdir"

  if [[ -e "$destdir$config" ]]; then
    say "kept the existing $destdir$config (never overwritten; the current example is $docdir/kvmmd.toml.example)"
  else
    sed 's|^# admin_group = "kvmm-admin"$|admin_group = "kvmm-admin"|' "$here/kvmmd.toml.example" >"$tmp/kvmmd.toml"
    grep -qx 'admin_group = "kvmm-admin"' "$tmp/kvmmd.toml" ||
      die "kvmmd.toml.example has no '# admin_group = \"kvmm-admin\"' line to turn on; fix the example"
    install -D -m 0644 "$tmp/kvmmd.toml" "$destdir$config"
    say "installed $destdir$config (the example with admin_group = \"kvmm-admin\" turned on)"
  fi

  if [[ "$live_systemd" == yes ]]; then
    systemd-sysusers kvmm.conf || die "systemd-sysusers kvmm.conf failed; the files are installed"
    systemctl daemon-reload || die "systemctl daemon-reload failed; the files are installed"
    say "created the user kvmm and the groups kvmm-clients and kvmm-admin; reloaded systemd. Next:"
  else
    if [[ -n "$destdir" ]]; then
      say "staged in $destdir; on the target host, as root:"
    else
      say "systemd is not running as PID 1 here; where it is, as root:"
    fi
    printf '  %s\n' "systemd-sysusers kvmm.conf" "systemctl daemon-reload"
  fi
  printf '  %s\n' "${next_steps[@]}"
}

do_uninstall() {
  local f
  if [[ "$live_systemd" == yes ]]; then
    systemctl disable --now kvmmd.service "${units[@]:0:3}" ||
      say "could not stop and disable every unit (already gone?); removing the files anyway"
  fi
  while IFS= read -r f; do
    if [[ -e "$destdir$f" || -L "$destdir$f" ]]; then
      rm -f "$destdir$f"
      say "removed $destdir$f"
    fi
  done < <(installed_files)
  if [[ -n "$python_module" ]]; then
    # What Python compiled from the module when it was imported.
    rm -f "$destdir$python_dir"/__pycache__/kvmm.*.pyc
    rmdir "$destdir$python_dir/__pycache__" 2>/dev/null || true
  fi
  rmdir "$destdir$dropindir" "$destdir$docdir" "$destdir$(dirname "$pkgconfig")" 2>/dev/null || true
  if [[ -z "$destdir" && "$EUID" -eq 0 ]]; then
    ldconfig || say "ldconfig failed"
  fi

  if [[ "$purge" == yes ]]; then
    for f in "$destdir$config" "$destdir$statedir"; do
      if [[ -e "$f" ]]; then
        rm -rf "$f"
        say "purged $f"
      fi
    done
    rmdir "$destdir$confdir" 2>/dev/null || true
  else
    [[ ! -e "$destdir$config" ]] || say "left $destdir$config (your configuration; --purge removes it)"
    [[ ! -e "$destdir$statedir" ]] || say "left $destdir$statedir (the flash file; --purge removes it)"
  fi
  if [[ "$live_systemd" == yes ]]; then
    systemctl daemon-reload || say "systemctl daemon-reload failed"
  fi
  say "left the user kvmm and the groups kvmm-clients and kvmm-admin: removing system users is the distribution's call"
}

case "$action" in
  install) do_install ;;
  uninstall) do_uninstall ;;
esac
