//! Collectors armed around windows.
pub mod symbolize;
