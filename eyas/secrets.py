"""What may reach a shell, and what must never be printed.

    check_env_name("HF_TOKEN"); check_address("gpu-node-1")        # ValueError otherwise
    # -> "... *** ... --api-key *** ..."
    register(token); redact(f"... {token} ... --api-key abc ...")

Config values that reach a command on a host are quoted (shlex) or, where quoting cannot help (an
environment variable's name, an address), validated by the functions here. Secret values (the
server's `secret_env` and `env_from`, an `--api-key`) reach the server process without ever being
part of a command string (eyas/server/hosts.py), and every printed form (errors, the launch
command, log tails) goes through `redact`, which hides every value registered in this process and
the value of every secret flag. docs/operations.md, "Secrets", is the operator's side of this.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from typing import Iterable

from eyas.errors import InvalidInput

MASK = "***"
PYDANTIC_MASK = (
    "**********"  # what a SecretStr becomes in model_dump(mode="json"), so in Prefect's parameters
)
SECRET_FLAGS = ("--api-key",)  # launch flags whose value is a secret (SGLang's --api-key)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
# Names that say "I hold a secret": refused in plain `env`, where values are shown and stored.
_SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.IGNORECASE
)
# One shell word: quoted parts, escapes and plain characters, as shlex.quote/join write them.
_WORD = r"""(?:'[^']*'|"(?:[^"\\]|\\.)*"|\\.|[^\s'"\\])+"""
# argparse's usage text names a flag's value by its metavar (`[--api-key API_KEY]`): not a secret,
# and masking it would swallow the text after it
_METAVARS = "|".join(f.lstrip("-").upper().replace("-", "_") for f in SECRET_FLAGS)
_FLAGS = "|".join(re.escape(f) for f in SECRET_FLAGS)
_FLAG_VALUE = re.compile(rf"({_FLAGS})(=|\s+)(?!(?:{_METAVARS})(?:[\]\s)]|$))({_WORD})")
_KEY_VALUE = re.compile(
    r"""(\bapi_key['"]?\s*[:=]\s*)(['"])(.*?)\2"""
)  # SGLang's ServerArgs(... api_key='...')

_registered: set[str] = set()
_lock = threading.Lock()


def check_env_name(name: str) -> str:
    """An environment variable name that is safe to write unquoted in `export NAME=...`."""
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise InvalidInput(
            f"{name!r} is not an environment variable name "
            f"(letters, digits and '_', not starting with a digit)"
        )
    return name


def check_address(value: str) -> str:
    """An IP address or a host name (RFC 1123 labels), nothing a shell could read as more."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if len(value) <= 253 and _HOSTNAME.fullmatch(value):
        return value
    raise InvalidInput(f"{value!r} is neither an IP address nor a host name")


def looks_secret(name: str) -> bool:
    """HF_TOKEN, OPENAI_API_KEY, AWS_SECRET_ACCESS_KEY, ...: names whose values must not be
    shown."""
    return bool(_SECRET_NAME.search(name))


def register(*values: str) -> None:
    """Remember secret values of this process: `redact` hides them wherever they turn up."""
    with _lock:
        _registered.update(v for v in values if isinstance(v, str) and len(v) >= 4)


def redact(text: str) -> str:
    """text with every registered secret and every secret flag's value replaced by ***."""
    if not text:
        return text
    with _lock:
        known = sorted(_registered, key=len, reverse=True)
    for value in known:
        text = text.replace(value, MASK)
    text = _FLAG_VALUE.sub(lambda m: f"{m[1]}{m[2]}{MASK}", text)
    return _KEY_VALUE.sub(lambda m: f"{m[1]}{m[2]}{MASK}{m[2]}", text)


def redact_args(args: Iterable[str]) -> list[str]:
    """An argument vector with the value of every secret flag (`--api-key K`, `--api-key=K`)
    hidden."""
    out: list[str] = []
    hide_next = False
    for a in args:
        flag, eq, _ = a.partition("=")
        if hide_next:
            out.append(MASK)
            hide_next = False
        elif flag in SECRET_FLAGS and eq:
            out.append(f"{flag}={MASK}")
        else:
            hide_next = a in SECRET_FLAGS
            out.append(redact(a))
    return out


def secret_flag_values(args: Iterable[str]) -> list[str]:
    """The values of the secret flags in an argument vector (to `register` them)."""
    args, out = list(args), []
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in SECRET_FLAGS:
            out.append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return out
