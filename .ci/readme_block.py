"""Print the commands of the README's fenced bash block whose comment names it, for .ci/run to run verbatim.

    python .ci/readme_block.py "the main job"     # the Quickstart's first command

Exits non-zero when no block (or more than one) has a comment line containing the phrase, so that
a README edit that drops or renames the block fails CI instead of skipping the check.
"""

import re
import sys
from pathlib import Path

phrase = sys.argv[1]
readme = Path(__file__).resolve().parent.parent / "README.md"
blocks = re.findall(r"^```bash\n(.*?)^```", readme.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
found = [b for b in blocks if any(line.startswith("#") and phrase in line for line in b.splitlines())]
if len(found) != 1:
    sys.exit(f"README.md: {len(found)} bash blocks have a comment naming {phrase!r}; .ci/run needs exactly one")
print("\n".join(line for line in found[0].splitlines() if line.strip() and not line.lstrip().startswith("#")))
