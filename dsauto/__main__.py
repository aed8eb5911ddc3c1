from dsauto.cli import main

raise SystemExit(main())
