"""`python -m router ...` is the `roundhouse` command."""

from router.cli import main

raise SystemExit(main())
