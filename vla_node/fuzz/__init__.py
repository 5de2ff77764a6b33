"""Fuzzing of every decoder of outside input: wire messages, MCAP drives, launch files, checkpoint directories.

`targets` holds one function per decoder that checks its contract (a valid object or the documented error, one
bounded line naming the problem; nothing else, no hang, no huge allocation), `corpus` the seed inputs built in
code, `mutate` and `formats` the byte- and format-level mutations, `runner` the time-boxed campaign behind
`vla-node fuzz`, run input by input in a `worker` process so a hang or a crash is caught and counted.
"""
