"""``python -m genengine.cli``: the ``genengine`` command (``torchrun ... -m genengine.cli bench`` runs it per rank)."""

from __future__ import annotations

import sys

from genengine.cli import main

sys.exit(main())
