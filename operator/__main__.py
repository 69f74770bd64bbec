"""``python -m misat_operator`` runs the operator."""

from .main import main

raise SystemExit(main())
