"""Compile the installed packages' Python to bytecode, on every core.

    python tools/compile_installed.py      (``make install`` runs it, after ``pip install --no-compile``)

pip compiles what it installs one file at a time: 80 of the install's 150 s on two cores. Where
``PYTHONDONTWRITEBYTECODE`` is set (as on the machines the suite runs on) nothing is compiled when it
is imported, so every interpreter the suite starts would compile all it imports again. Left out, as
nothing that runs imports them: the packages' own test suites (``test`` and ``tests`` folders; PyTorch
imports its test helpers, ``torch.testing``, and they are kept) and the model families of
Transformers other than the ones everystep's integration loads (an import of another compiles it
then, as any uncompiled module is). A file written for a later Python does not compile
and is passed over, as pip passes it over.
"""

from __future__ import annotations

import compileall
import re
import sysconfig

SKIPPED = re.compile(r"/tests?/|/transformers/models/(?!auto/|gpt2/|encoder_decoder/)[^/]+/")


def main() -> None:
    for path in dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])):
        compileall.compile_dir(path, quiet=2, workers=0, rx=SKIPPED)


if __name__ == "__main__":
    main()
