"""The ``streamkv`` command (main.py) and its subcommands: ``serve`` (serve.py, its flags in
serve_args.py), ``chat`` (chat.py), ``generate`` and ``bench`` (main.py); common.py holds
what they share and config_file.py reads ``--config FILE.yaml``."""
