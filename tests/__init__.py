"""The test suite, a folder per room (kernels, storage, engine, serve, bench, app) and, at the top, the house's own
rules (test_rooms.py: imports; test_history.py: the project's words). tests/conftest.py holds what every room
shares (the interpreter for Triton on the CPU, the real embedded model); each room's conftest.py its own fixtures."""
