"""What a host's SGLang install is, through the server's python (importing neither sglang nor
torch): its version, package and site folders, eyas's state file there, the sha256 of the files
named, whether the site is writable, whether torch and safetensors import, and optionally the
target's architectures from its config.json. One JSON line.

    python -c SOURCE [--target-config CONFIG_JSON] [REL_PATH ...]
"""

import hashlib
import importlib.metadata as md
import importlib.util as iu
import json
import os
import sys

#: eyas's record of what it patched, in SGLang's package folder (eyas/server/sglang_probe.py)
STATE = ".eyas-patch.json"


def target_config(path: str) -> dict:
    out: dict = {"path": path}
    try:
        with open(path) as f:
            out["architectures"] = json.load(f).get("architectures")
    except FileNotFoundError:
        out["missing"] = True
    except (OSError, ValueError, AttributeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def main(args: list[str]) -> dict:
    sys.path[:] = [p for p in sys.path if p]  # not the login directory: what the server imports
    out = {
        "python": sys.executable,
        "version": None,
        "package_dir": None,
        "site_dir": None,
        "state": None,
        "sha256": {},
        "writable": False,
        "target_config": None,
    }
    if args[:1] == ["--target-config"]:
        out["target_config"], args = target_config(args[1]), args[2:]
    try:
        out["version"] = md.version("sglang")
    except md.PackageNotFoundError:
        pass
    spec = iu.find_spec("sglang")
    if spec is not None and spec.submodule_search_locations:
        pkg = list(spec.submodule_search_locations)[0]
        site = os.path.dirname(pkg)
        out.update(
            package_dir=pkg,
            site_dir=site,
            writable=os.access(site, os.W_OK) and os.access(pkg, os.W_OK),
        )
        try:
            with open(os.path.join(pkg, STATE)) as f:
                out["state"] = json.load(f)
        except FileNotFoundError:
            pass
        except ValueError as e:
            out["state"] = {"unreadable": str(e)}
        for rel in args + [f["path"] for f in (out["state"] or {}).get("files", [])]:
            try:
                with open(os.path.join(site, rel), "rb") as f:
                    out["sha256"][rel] = hashlib.sha256(f.read()).hexdigest()
            except FileNotFoundError:
                out["sha256"][rel] = None
    out["missing_modules"] = [m for m in ("torch", "safetensors") if iu.find_spec(m) is None]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
