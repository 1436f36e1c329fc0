"""`python -m engine ...`: the entry point the router's supervisor starts."""

from engine.process.main import main

raise SystemExit(main())
