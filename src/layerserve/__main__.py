"""`python -m layerserve` runs the command line."""

from layerserve.cli import main

raise SystemExit(main())
