"""What a name, host, environment key, model source or jump host may be; one grammar each.

Every string that reaches a shell, a header or a file name on a node passes one of these at
the door. Each check raises ValueError("what | how to fix"), the form base/validation.py reports.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

from fleetctl.base.errors import shown, what_and_fix
from fleetctl.base.limits import MAX_HOST, MAX_MODEL_NAME, MAX_NAME, MAX_TEXT, MAX_USER

_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")
# Served model names keep ':' and '/' ("meta-llama/Llama-3.1-8B-Instruct" is what clients send).
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
_DNS_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]*")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


# Unicode's Cc (C0, DEL, C1) and the line and paragraph separators (Zl, Zp).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")


def control_char(text: str) -> str | None:
    """The first control or line-separator character in `text`, or None."""
    m = _CONTROL.search(text)
    return m.group() if m else None


def name(value: str, what: str = "name") -> str:
    """Node, label and variant names: hostname-like, [A-Za-z0-9._-], at most 63 characters."""
    if len(value) > MAX_NAME:
        raise ValueError(f"{what} {shown(value)} is longer than {MAX_NAME} characters | shorten it")
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"{what} {shown(value)} is not a valid name | use letters, digits, '.', '_' and "
            "'-', starting and ending with a letter or digit"
        )
    return value


def model_name(value: str) -> str:
    """A served model name: a name that may also hold ':' and '/'."""
    if len(value) > MAX_MODEL_NAME or not _MODEL_NAME.fullmatch(value):
        raise ValueError(
            f"model name {shown(value)} is not a valid served model name | use at most "
            f"{MAX_MODEL_NAME} letters, digits, '.', '_', '-', ':' or '/'"
        )
    return value


def host(value: str) -> str:
    """A hostname, IPv4 or IPv6 address: no scheme, user, port or brackets."""
    if "://" in value:
        raise ValueError(
            f"host {shown(value)} holds a URL scheme | write only the address; fleetctl "
            "reaches nodes over SSH"
        )
    if "@" in value:
        raise ValueError(
            f"host {shown(value)} holds a user | write only the address and put the user "
            "in 'user:' (of the node or of ssh:)"
        )
    if value.startswith("[") and value.endswith("]"):
        raise ValueError(f"host {shown(value)} has brackets | write the IPv6 address without them")
    if _IPV4.fullmatch(value):  # the common case, without ipaddress's cost per node
        return value
    if "%" in value and ":" in value:
        # A zone names an interface of this machine: the node binds its server to the same
        # address on interfaces of its own, and a URL would need the zone escaped.
        raise ValueError(
            f"host {shown(value)} has an IPv6 zone ('%...') | write a global or unique-local "
            "address such as fd00::11, or a hostname"
        )
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if value.count(":") == 1 and value.rpartition(":")[2].isdigit():
        raise ValueError(
            f"host {shown(value)} holds a port | write only the address and put the port "
            "in 'port:' (of the node or of ssh:)"
        )
    labels = value.rstrip(".").split(".")
    if (
        len(value) > MAX_HOST
        or not all(_DNS_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()  # 10.0.0.300 is a bad address, not a name
    ):
        raise ValueError(
            f"host {shown(value)} is not a hostname, IPv4 or IPv6 address | write e.g. "
            "gpu-1.example.internal, 10.0.1.11 or fd00::11"
        )
    return value


def user(value: str) -> str:
    """A login name on the node."""
    if len(value) > MAX_USER or not _USER.fullmatch(value):
        raise ValueError(
            f"user {shown(value)} is not a login name | use letters, digits, '.', '_' and '-'"
        )
    return value


def env_key(value: str) -> str:
    """An environment variable name as POSIX sh and systemd read it."""
    if len(value) > MAX_NAME * 2 or not ENV_KEY.fullmatch(value):
        raise ValueError(
            f"environment variable name {shown(value)} is not valid | use letters, digits "
            "and '_', not starting with a digit"
        )
    return value


def source(value: str) -> str:
    """A Hugging Face id (org/name) or a path on the node; never an option."""
    if value.startswith("-"):
        raise ValueError(
            f"source {shown(value)} starts with '-' | write a Hugging Face id (org/name) or "
            "a path; put vLLM options in vllm_args"
        )
    if len(value) > MAX_TEXT:
        raise ValueError(f"source is longer than {MAX_TEXT} characters | shorten it")
    if value.startswith(("/", "./", "../", "~/")) or _HF_ID.fullmatch(value):
        return value
    raise ValueError(
        f"source {shown(value)} is neither a Hugging Face id nor a path | write org/name, "
        "or a path starting with /, ./ or ~/"
    )


_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def adapter_source(value: str) -> str:
    """A LoRA adapter's files: a Hugging Face id, or a path on the node whose every part is a
    plain file name. The path reaches `--lora-modules name=path` on a shell's command line and,
    copied to nodes, a file system: no '..', no shell metacharacters, no spaces, no '='."""
    source(value)
    if _HF_ID.fullmatch(value) and not value.startswith(("./", "../", "~/")):
        return value
    try:
        return plain_path(value)
    except ValueError:
        raise ValueError(
            f"adapter source {shown(value)} is not a plain path | write org/name, or a path "
            "starting with /, ./ or ~/ whose parts use letters, digits, '.', '_' and '-' "
            "(no '..')"
        ) from None


def plain_path(value: str, what: str = "path") -> str:
    """A path whose every part is a plain file name, absolute or from ./ or ~/: what may
    reach a shell and a file system on either side of a copy."""
    head, _, rest = value.partition("/")
    parts = [p for p in rest.split("/") if p]
    if (
        len(value) > MAX_TEXT
        or head not in ("", ".", "~")
        or not parts
        or not all(_PATH_PART.fullmatch(p) for p in parts)
    ):
        raise ValueError(
            f"{what} {shown(value)} is not a plain path | write a path starting with /, ./ or "
            "~/ whose parts use letters, digits, '.', '_' and '-' (no '..')"
        )
    return value


def revision(value: str) -> str:
    if len(value) > 255 or not _REVISION.fullmatch(value):
        raise ValueError(
            f"revision {shown(value)} is not a branch, tag or commit | write e.g. main or "
            "a commit hash"
        )
    return value


def command_word(value: str) -> str:
    """A word of `apply.vllm_command`: a program or its argument, never an option first."""
    if value.startswith("-"):
        raise ValueError(
            f"vllm_command starts with {shown(value)} | name the vllm program first, "
            "e.g. /opt/vllm/bin/vllm"
        )
    return value


def http_url(host: str, port: int, path: str = "") -> str:
    """`http://host:port/path`, with an IPv6 address in brackets: every server URL's one home."""
    return f"http://{host_port(host, port)}{path}"


@dataclass(frozen=True)
class Jump:
    """One ProxyJump hop, as `[user@]host[:port]` names it."""

    user: str | None
    host: str
    port: int


def jump(spec: str) -> Jump:
    """Parse a ProxyJump spec; one hop ([user@]host[:port], IPv6 in brackets with a port)."""
    if "," in spec:
        raise ValueError(
            f"proxy_jump {shown(spec)} names several hops | fleetctl takes one; chain further "
            "hops in ~/.ssh/config"
        )
    if "://" in spec:
        raise ValueError(f"proxy_jump {shown(spec)} holds a URL scheme | write [user@]host[:port]")
    user, _, hostport = spec.rpartition("@")
    if user and not _USER.fullmatch(user):
        raise ValueError(
            f"proxy_jump user {shown(user)} is not a user name | fix the part before @"
        )
    port_text = ""
    if hostport.startswith("["):
        addr, sep, rest = hostport[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"proxy_jump {shown(spec)} is malformed | write [user@][fd00::1]:22")
        port_text = rest[1:]
    elif hostport.count(":") == 1:
        addr, _, port_text = hostport.partition(":")
    else:
        addr = hostport
    try:
        host(addr)
    except ValueError as e:
        what = what_and_fix(e)[0]
        raise ValueError(f"proxy_jump {shown(spec)}: {what} | write [user@]host[:port]") from None
    port = 22
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(
                f"proxy_jump port {shown(port_text)} is not 1..65535 | write [user@]host[:port]"
            )
        port = int(port_text)
    return Jump(user or None, addr, port)


_DIGITS = re.compile(r"(\d+)")


@functools.lru_cache(maxsize=1 << 17)
def natural_key(name: str) -> tuple[object, ...]:
    """Sort rtx-2 before rtx-10 (cached: big plans sort the same node names many times)."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(name))


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address in brackets (`[fd00::11]:22`), as OpenSSH and URLs
    write it: the one home of every SSH target, server address and URL authority."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
