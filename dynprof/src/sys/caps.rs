//! See [`crate::sys`].
