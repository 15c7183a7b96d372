//! Triggers produce plans and commands for the window scheduler; they never
//! touch probes or files themselves.
