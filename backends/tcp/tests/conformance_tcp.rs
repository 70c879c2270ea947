//! The conformance suite over real TCP sockets on loopback.

mod common;

ironweave_transport::conformance_suite!(common::world);
