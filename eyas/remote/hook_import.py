"""Import eyas's hook from a staging folder with the server's python, before the patch stage writes
anything into SGLang: one JSON line, the error and the missing module's name if it fails.

    python -c SOURCE STAGING_FOLDER
"""

import json
import sys


def main(staging: str) -> dict:
    sys.path[:] = [staging] + [p for p in sys.path if p]
    try:
        import eyas_sglang_hook
    except BaseException as e:
        return {"error": f"{type(e).__name__}: {e}", "missing": getattr(e, "name", None)}
    return {"error": None, "file": eyas_sglang_hook.__file__}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
