"""A module only an env_fn imports (tests/hosts/test_preimport.py): never imported by
the controller, so a warm parent has it only if it pre-imported it."""

VALUE = 42
