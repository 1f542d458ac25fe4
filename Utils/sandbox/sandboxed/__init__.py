"""The code that runs inside the code sandbox (Utils/sandbox/ starts it): `launch` (the supervisor of one
sandboxed process), `confine` (the kernel's limits it sets), `candidate` (runs the program and answers
calls), `checker` (runs the tests and writes the verdict), `wire` (the values between those two).

The sandboxed interpreter imports this package from a read-only copy with the standard library only
(`python -I -S`), so nothing here imports the rest of the project.
"""
