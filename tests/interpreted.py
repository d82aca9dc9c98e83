"""Running a script under Triton's interpreter on CPU tensors. TRITON_INTERPRET is read when triton is first
imported, so each script runs in a fresh Python process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

#: put before each script: the interpreter hands a loaded or scalar argument on as a 1-element array, which
#: numpy 2 will not int() (a loop bound or an index), so `__index__` takes its element
INDEX_PATCH = textwrap.dedent(
    """
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    """
)


def run_interpreted(script: str, *argv: str, timeout: float = 600) -> str:
    """Run `script` (with INDEX_PATCH first) under TRITON_INTERPRET=1 with arguments `argv`; its stdout. Fails
    the calling test, with the end of its stderr, if the script fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", INDEX_PATCH + script, *argv], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
