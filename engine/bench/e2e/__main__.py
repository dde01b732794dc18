"""`python -m engine.bench.e2e`: the end-to-end benchmark (engine.bench.e2e.report.main)."""

from engine.bench.e2e.report import main

raise SystemExit(main())
