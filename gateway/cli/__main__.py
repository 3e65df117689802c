"""`python -m gateway.cli`: the `sluice` command."""

from gateway.cli.main import main

raise SystemExit(main())
