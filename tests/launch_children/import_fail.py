import no_such_module_for_rtrain_tests  # noqa: F401
