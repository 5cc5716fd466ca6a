"""Which address a request comes from, as the per-address limits count it: the one the proxy vouches for.

A client can send any X-Forwarded-For it likes. A proxy in front of the app (a Hugging Face Space's,
or one's own nginx) appends the address it received the request from, or replaces the header with
it; either way what the client wrote stays to the left of what the proxies wrote. So the client's
address is read from the right:
- `GHOSTED_APP_PROXY_HOPS=N` (proxies that append, the last one's entry included): the N-th entry
  from the right;
- by default, the rightmost entry that is not an internal address (10/8, 172.16/12, 192.168/16,
  100.64/10, loopback, link-local, fc00::/7): the address the outermost proxy received the request
  from, whatever internal hops appended after it.
The header counts only on a Space or where the operator trusts it (GHOSTED_APP_TRUST_FORWARDED=1);
elsewhere, and when it holds no address, the socket's peer is the client. Entries that are not IP
addresses are skipped, and only the last MAX_ENTRIES are read.
"""

from __future__ import annotations

import ipaddress
import os

TRUST_ENV, HOPS_ENV = "GHOSTED_APP_TRUST_FORWARDED", "GHOSTED_APP_PROXY_HOPS"
MAX_ENTRIES = 32  # a header's entries read, from the right (the client may send thousands)
INTERNAL = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "::1/128", "fc00::/7", "fe80::/10"))


def trust_forwarded() -> bool:
    """Whether X-Forwarded-For names the client: on a Space (its proxy sets it), or where the operator says."""
    value = os.environ.get(TRUST_ENV, "").strip().lower()
    return value in ("1", "true", "yes", "on") or (value == "" and bool(os.environ.get("SPACE_ID")))


def proxy_hops() -> int:
    """GHOSTED_APP_PROXY_HOPS: how many proxies append to X-Forwarded-For (0, the default: the rightmost public
    entry, see the module's docstring)."""
    value = os.environ.get(HOPS_ENV, "").strip()
    return max(0, int(value)) if value.isdigit() else 0


def _address(entry: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    entry = entry.strip().strip('"')
    if entry.startswith("[") and "]" in entry:  # [v6]:port
        entry = entry[1:entry.index("]")]
    elif entry.count(":") == 1:  # v4:port
        entry = entry.split(":")[0]
    try:
        return ipaddress.ip_address(entry)
    except ValueError:
        return None


def vouched_address(forwarded_for: str, hops: int = 0) -> str:
    """The client address the proxies vouch for in an X-Forwarded-For value ('' when it names none)."""
    entries = [a for a in map(_address, forwarded_for.split(",")[-MAX_ENTRIES:]) if a is not None]
    if not entries:
        return ""
    if hops:
        return str(entries[-min(hops, len(entries))])
    public = [a for a in entries if not any(a in net for net in INTERNAL if a.version == net.version)]
    return str(public[-1] if public else entries[-1])


def client_host(forwarded_for: str, socket_host: str) -> str:
    """The client's address from the X-Forwarded-For header (when trusted) and the socket's peer."""
    forwarded = vouched_address(forwarded_for, proxy_hops()) if trust_forwarded() and forwarded_for else ""
    return forwarded or socket_host or ""
