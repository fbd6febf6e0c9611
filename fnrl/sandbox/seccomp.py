"""The sandbox's seccomp filter, compiled by libseccomp (the library systemd, bubblewrap's
users and container runtimes use) and handed to bubblewrap as BPF (`bwrap --seccomp FD`).

Tool code may compute, print, read the files the sandbox shows it and write its private
tmpfs. The filter refuses (EPERM) what containment does not need and a hostile tool
would use: new processes (fork, vfork, clone without CLONE_THREAD; clone3 answers
ENOSYS so glibc falls back to clone, whose flags the filter can read), sockets other
than AF_UNIX, namespaces (unshare, setns), tracing and other processes' memory, mounts,
keyrings, BPF, userfaultfd, perf events, io_uring, kernel modules and the rest of the
administrative calls. Syscalls of another ABI (32-bit on x86-64) kill the process:
libseccomp's default for a foreign architecture.

Reached through ctypes on libseccomp.so.2 (present wherever systemd is); `compile_filter`
returns None where the library is missing, and the sandbox says so in its mode.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import tempfile

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7
CLONE_THREAD = 0x00010000
AF_UNIX = 1

DENIED = (
    "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "pidfd_getfd", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "userfaultfd", "perf_event_open",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "personality", "uselib", "lookup_dcookie",
    "name_to_handle_at", "open_by_handle_at", "iopl", "ioperm", "settimeofday",
    "clock_settime", "adjtimex", "sethostname", "setdomainname",
)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


def _library():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def compile_filter() -> bytes | None:
    """The filter as a BPF program (what `bwrap --seccomp` reads), or None when
    libseccomp is not installed."""
    lib = _library()
    if lib is None:
        return None
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(name: str, action: int, *cmps: _ArgCmp) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:   # not a syscall of this architecture (e.g. fork on arm64)
            return
        arr = (_ArgCmp * len(cmps))(*cmps) if cmps else None
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

    try:
        eperm = _errno_action(errno.EPERM)
        for name in DENIED:
            rule(name, eperm)
        rule("clone", eperm, _ArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0))
        rule("clone3", _errno_action(errno.ENOSYS))
        rule("socket", eperm, _ArgCmp(0, SCMP_CMP_NE, AF_UNIX, 0))
        rule("socketpair", eperm, _ArgCmp(0, SCMP_CMP_NE, AF_UNIX, 0))
        with tempfile.TemporaryFile() as f:
            rc = lib.seccomp_export_bpf(ctx, f.fileno())
            if rc < 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)
