from hf_specdec.cli.main import main

raise SystemExit(main())
