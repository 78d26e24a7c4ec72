//! CRIU's image formats as stasis reads and writes them.
//!
//! - [`pages`]: a dump's memory as CRIU hands it over, runs of pages for each pagemap, and the
//!   sink they go to: what the page server receives and the store keeps;
//! - [`images`]: the pagemap and page files stasis rebuilds for a restore, and what it reads of
//!   a dump's inventory, process tree and address spaces;
//! - [`image_set`]: whether a dump's images are a whole set a restore can use;
//! - [`cow`]: which memory a restored child shares copy-on-write with its parent;
//! - [`running`]: which threads a dump caught at work, outside a system call.
//!
//! Nothing here runs CRIU or touches the kernel: it is bytes in, bytes out, and files.

#![deny(unsafe_code)]

pub mod cow;
pub mod image_set;
#[cfg(test)]
mod image_set_tests;
pub mod images;
pub mod pages;
pub mod running;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
