from sparsekv.cli import main

raise SystemExit(main())
