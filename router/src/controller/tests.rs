//! Pure-core tests of the controller (filled below).
