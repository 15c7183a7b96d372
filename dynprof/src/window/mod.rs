//! Window plans and the scheduler that opens and closes windows at exact
//! step boundaries. (Being built; see issue 4.)
pub mod args;
