"""The last step of kvmmd-sandbox: seccomp filters, W^X and a private keyring, then execve.

Usage: python3 -I seccomp_exec.py PROGRAM [ARGS...]

Runs with no capabilities and no_new_privs already set (setpriv, in kvmmd-sandbox) and replaces
itself with PROGRAM, so PROGRAM keeps this process's pid. What it applies, as kvmmd.service asks:

  KeyringMode=private         a fresh anonymous session keyring (keyctl JOIN_SESSION_KEYRING)
  MemoryDenyWriteExecute=yes  prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN), inherited across
                              execve, and systemd 252's seccomp rules (mmap W+X, mprotect and
                              pkey_mprotect adding X, shmat SHM_EXEC: EPERM)
  RestrictAddressFamilies=AF_UNIX
                              socket()/socketpair() with any other family: EAFNOSUPPORT
  RestrictNamespaces=yes      setns: EPERM; unshare/clone with any CLONE_NEW* flag: EPERM;
                              clone3: ENOSYS (its flags are behind a pointer; libc falls back
                              to clone)
  RestrictRealtime=yes        sched_setscheduler with a policy other than OTHER, BATCH, IDLE:
                              EPERM
  RestrictSUIDSGID=yes        chmod/fchmod/fchmodat, mkdir/mkdirat, mknod/mknodat, creat, and
                              open/openat with O_CREAT, setting S_ISUID or S_ISGID: EPERM;
                              openat2: ENOSYS (its mode is behind a pointer)
  LockPersonality=yes         personality() to anything but the current personality: EPERM
  SystemCallArchitectures=native
                              the filters are built for the native ABI only; calls through
                              another ABI (i386 int 0x80, x32) kill the process
  SystemCallFilter=@system-service, SystemCallFilter=~@privileged @resources,
  SystemCallErrorNumber=EPERM an allow list, every other call EPERM. The groups come from the
                              installed `systemd-analyze syscall-filter`, nested @groups
                              expanded; as in systemd, a later ~ list removes its calls from the
                              allow list; names this libseccomp cannot resolve are skipped, as
                              systemd (linked against the same libseccomp) skips them.

Each setting is its own filter, as systemd installs them; the kernel runs them all and the most
restrictive answer wins (an errno beats allow). The allow list is installed last, so the other
filters can still be loaded, and the execve that follows is allowed by it (@default).

Environment: KVMM_SANDBOX_VERBOSE=1 prints what was installed on stderr. KVMM_SANDBOX_AUDIT=1
has the kernel log every call a filter refuses (SECCOMP_FILTER_FLAG_LOG), except RestrictNamespaces
(whose clone3 -> ENOSYS every thread start meets by design, and would crowd out the rest of a
rate-limited log): `dmesg | grep type=1326` then names the process, the call number and the
action, which finds calls a program needs but the unit refuses.
"""

import ctypes
import ctypes.util
import os
import subprocess
import sys
from typing import NoReturn

LIBSECCOMP = "libseccomp.so.2"

# libseccomp's ABI (seccomp.h, libseccomp 2.5).
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_FLTATR_ACT_BADARCH = 2
SCMP_FLTATR_CTL_LOG = 6
SCMP_CMP_NE = 1
SCMP_CMP_EQ = 4
SCMP_CMP_GT = 6
SCMP_CMP_MASKED_EQ = 7

EPERM = 1
ENOSYS = 38
EAFNOSUPPORT = 97

AF_UNIX = 1
PROT_WRITE = 0x2
PROT_EXEC = 0x4
SHM_EXEC = 0o100000
O_CREAT = 0o100
S_ISUID = 0o4000
S_ISGID = 0o2000
SCHED_OTHER, SCHED_BATCH, SCHED_IDLE = 0, 3, 5
# Every namespace systemd 252 knows (RestrictNamespaces=yes forbids all of them).
CLONE_NEW = {
    "cgroup": 0x02000000,
    "ipc": 0x08000000,
    "net": 0x40000000,
    "mnt": 0x00020000,
    "pid": 0x20000000,
    "user": 0x10000000,
    "uts": 0x04000000,
    "time": 0x00000080,
}
PR_SET_MDWE = 65
PR_MDWE_REFUSE_EXEC_GAIN = 1
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_KEYCTL_X86_64 = 250
PERSONALITY_QUERY = 0xFFFFFFFF


# One rule: (action, call name, [(argument, comparison, datum a, datum b)]).
Rule = tuple[int, str, list[tuple[int, int, int, int]]]


def scmp_act_errno(errno: int) -> int:
    return 0x00050000 | (errno & 0xFFFF)


class ArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def fail(message: str) -> NoReturn:
    print(f"kvmmd-sandbox: {message}", file=sys.stderr)
    sys.exit(77)


class Seccomp:
    """The few libseccomp calls used here, raising on failure."""

    def __init__(self, audit: bool) -> None:
        self.audit = audit
        try:
            self.lib = ctypes.CDLL(LIBSECCOMP, use_errno=True)
        except OSError as e:
            fail(f"libseccomp is not installed ({e})")
        self.lib.seccomp_init.restype = ctypes.c_void_p
        self.lib.seccomp_init.argtypes = [ctypes.c_uint32]
        self.lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(ArgCmp),
        ]
        self.lib.seccomp_load.argtypes = [ctypes.c_void_p]
        self.lib.seccomp_release.argtypes = [ctypes.c_void_p]
        self.lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
        self.lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]

    def resolve(self, name: str) -> int | None:
        """The native number of a call, or None where it has none (unknown, or another ABI's)."""
        nr = self.lib.seccomp_syscall_resolve_name(name.encode())
        return nr if nr >= 0 else None

    def load(self, default: int, rules: list[Rule], audit: bool) -> int:
        """Installs one filter: `default` plus (action, call, [(arg, op, a, b)]) rules for the
        native ABI; another ABI kills the process; refusals are logged if `audit`. Returns how many
        rules went in."""
        ctx = self.lib.seccomp_init(default)
        if not ctx:
            raise OSError("seccomp_init failed")
        try:
            check(self.lib.seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS), "attr_set")
            if audit and self.audit:
                check(self.lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_LOG, 1), "attr_set")
            added = 0
            for action, name, cmps in rules:
                nr = self.resolve(name)
                if nr is None:
                    continue
                array = (ArgCmp * max(len(cmps), 1))(*[ArgCmp(*c) for c in cmps])
                rc = self.lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
                check(rc, f"a rule for {name}")
                added += 1
            check(self.lib.seccomp_load(ctx), "seccomp_load")
            return added
        finally:
            self.lib.seccomp_release(ctx)


def check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"libseccomp: {what}: {os.strerror(-rc)}")


def syscall_groups() -> dict[str, list[str]]:
    """Every group `systemd-analyze syscall-filter` lists, as its members in order (calls and
    nested @groups)."""
    try:
        out = subprocess.run(
            ["systemd-analyze", "syscall-filter"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        fail(f"cannot list the system call groups with systemd-analyze ({e})")
    groups: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith(" ") and current is not None:
            name = line.strip()
            if name and not name.startswith("#"):
                current.append(name)
        else:
            current = None
    return groups


def expand(group: str, groups: dict[str, list[str]], seen: frozenset[str] = frozenset()) -> set[str]:
    if group not in groups:
        fail(f"systemd-analyze does not know the system call group {group}")
    names: set[str] = set()
    for member in groups[group]:
        if member.startswith("@"):
            if member not in seen:
                names |= expand(member, groups, seen | {group})
        else:
            names.add(member)
    return names


def allowed_calls(groups: dict[str, list[str]]) -> set[str]:
    """SystemCallFilter=@system-service, then SystemCallFilter=~@privileged @resources."""
    return expand("@system-service", groups) - expand("@privileged", groups) - expand("@resources", groups)


def deny(errno: int, name: str, *cmps: tuple[int, int, int, int]) -> Rule:
    return (scmp_act_errno(errno), name, list(cmps))


def masked(arg: int, bits: int) -> tuple[int, int, int, int]:
    return (arg, SCMP_CMP_MASKED_EQ, bits, bits)


def address_family_rules() -> list[Rule]:
    # systemd 252 filters socket() only; socketpair() is narrowed too (it only makes AF_UNIX
    # pairs in practice, and this keeps the probe honest).
    return [deny(EAFNOSUPPORT, call, (0, SCMP_CMP_NE, AF_UNIX, 0)) for call in ("socket", "socketpair")]


def namespace_rules() -> list[Rule]:
    rules = [deny(EPERM, "setns"), deny(ENOSYS, "clone3")]
    for flag in CLONE_NEW.values():
        rules += [deny(EPERM, "unshare", masked(0, flag)), deny(EPERM, "clone", masked(0, flag))]
    return rules


def realtime_rules() -> list[Rule]:
    permitted = (SCHED_OTHER, SCHED_BATCH, SCHED_IDLE)
    top = max(permitted)
    rules = [
        deny(EPERM, "sched_setscheduler", (1, SCMP_CMP_EQ, p, 0))
        for p in range(top)
        if p not in permitted
    ]
    return rules + [deny(EPERM, "sched_setscheduler", (1, SCMP_CMP_GT, top, 0))]


def suid_sgid_rules() -> list[Rule]:
    rules = [deny(ENOSYS, "openat2")]
    for bit in (S_ISUID, S_ISGID):
        for call, mode_arg in (
            ("chmod", 1),
            ("fchmod", 1),
            ("fchmodat", 2),
            ("fchmodat2", 2),
            ("mkdir", 1),
            ("mkdirat", 2),
            ("mknod", 1),
            ("mknodat", 2),
            ("creat", 1),
        ):
            rules.append(deny(EPERM, call, masked(mode_arg, bit)))
        rules.append(deny(EPERM, "open", masked(1, O_CREAT), masked(2, bit)))
        rules.append(deny(EPERM, "openat", masked(2, O_CREAT), masked(3, bit)))
    return rules


def write_execute_rules() -> list[Rule]:
    return [
        deny(EPERM, "mmap", masked(2, PROT_EXEC | PROT_WRITE)),
        deny(EPERM, "mprotect", masked(2, PROT_EXEC)),
        deny(EPERM, "pkey_mprotect", masked(2, PROT_EXEC)),
        deny(EPERM, "shmat", masked(2, SHM_EXEC)),
    ]


def personality_rules(libc: ctypes.CDLL) -> list[Rule]:
    current = libc.personality(ctypes.c_ulong(PERSONALITY_QUERY))
    if current < 0:
        raise OSError(ctypes.get_errno(), "personality query failed")
    return [deny(EPERM, "personality", (0, SCMP_CMP_NE, current, 0))]


def main() -> None:
    if len(sys.argv) < 2:
        fail("usage: seccomp_exec.py PROGRAM [ARGS...]")
    program, argv = sys.argv[1], sys.argv[1:]
    verbose = bool(os.environ.get("KVMM_SANDBOX_VERBOSE"))
    seccomp = Seccomp(audit=bool(os.environ.get("KVMM_SANDBOX_AUDIT")))
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    allow = sorted(allowed_calls(syscall_groups()))

    if libc.syscall(SYS_KEYCTL_X86_64, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        fail(f"cannot join a private session keyring: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        fail(f"prctl(PR_SET_MDWE) failed: {os.strerror(ctypes.get_errno())} (needs Linux 6.3)")

    installed = []
    for setting, rules in (
        ("MemoryDenyWriteExecute", write_execute_rules()),
        ("RestrictAddressFamilies", address_family_rules()),
        ("RestrictNamespaces", namespace_rules()),
        ("RestrictRealtime", realtime_rules()),
        ("RestrictSUIDSGID", suid_sgid_rules()),
        ("LockPersonality", personality_rules(libc)),
    ):
        n = seccomp.load(SCMP_ACT_ALLOW, rules, audit=setting != "RestrictNamespaces")
        installed.append(f"{setting}: {n} rules")
    # Last: once it is in, seccomp() itself is refused.
    n = seccomp.load(scmp_act_errno(EPERM), [(SCMP_ACT_ALLOW, name, []) for name in allow], audit=True)
    installed.append(f"SystemCallFilter: {n} of {len(allow)} calls allowed")
    if verbose:
        print("kvmmd-sandbox: " + "; ".join(installed), file=sys.stderr)
    os.execv(program, argv)


if __name__ == "__main__":
    main()
