"""TUN devices and network namespaces: the two kernel pieces the emulated cluster needs.

A TUN device is a network interface whose "wire" is a file descriptor: every IP packet the
kernel sends out of the interface can be read from the descriptor, and every packet written
to the descriptor arrives on the interface as if it came from the network. The emulated
cluster's forwarder holds one descriptor per host and moves packets between them.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct

#: ``ioctl`` request that binds a ``/dev/net/tun`` descriptor to a named interface
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001  #: layer-3 device: reads and writes are bare IP packets
IFF_NO_PI = 0x1000  #: no 4-byte packet-information header before each packet
CLONE_NEWNET = 0x40000000
IFNAMSIZ = 16
NETNS_DIR = "/var/run/netns"


def open_tun(name: str) -> int:
    """Create the TUN interface ``name`` and return its non-blocking descriptor.

    The interface lives as long as the descriptor is open; closing it (or the process
    exiting) removes the interface, in whatever namespace it has been moved to.
    """
    if len(name.encode()) >= IFNAMSIZ:
        raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ - 1} bytes")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as error:
        raise OSError(
            "/dev/net/tun is missing: load the tun module (modprobe tun) or run where TUN "
            "devices are available"
        ) from error
    try:
        request = struct.pack(f"{IFNAMSIZ}sH", name.encode(), IFF_TUN | IFF_NO_PI)
        fcntl.ioctl(fd, TUNSETIFF, request)
    except OSError:
        os.close(fd)
        raise
    return fd


def enter_namespace(namespace: str) -> None:
    """Move the calling thread into a network namespace: ``namespace`` is a name under
    ``/var/run/netns`` (``ip netns add``) or the path of a namespace file, such as
    ``/proc/<pid>/ns/net``.

    A network namespace belongs to a thread: threads started afterwards by this one inherit
    it, earlier ones keep theirs, and sockets keep the namespace they were created in. So
    call it from the main thread before the process group (gloo) starts its threads and
    opens its sockets.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    path = namespace if os.sep in namespace else os.path.join(NETNS_DIR, namespace)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(
                err, f"setns into network namespace {namespace!r} failed: {os.strerror(err)}"
            )
    finally:
        os.close(fd)
