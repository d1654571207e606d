"""``python -m kvferry.transfer [--transports rdma]``: which UCX this build uses and what
it offers, as JSON (see :mod:`kvferry.transfer.ucxinfo`)."""

import sys

from .ucxinfo import main

sys.exit(main())
