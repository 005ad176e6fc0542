"""Where the data stream stands, so that a resume continues at the exact next sample: the
position the loop consumed, the watched loader and its workers, the samplers, per-sample
randomness."""
