"""Fail at import, before any training starts (a startup failure rtrain does not retry)."""

import no_such_module_for_rtrain_tests  # noqa: F401
