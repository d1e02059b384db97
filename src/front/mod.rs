//! The front door: the accept loop and connections (`server`), the routes and thin handlers
//! (`http`, which asks `crate::clients` who may call and what their keys may spend), the write
//! deadline every client connection is served through (`send_deadline`), the hard stop reaching the requests
//! still running (`stop`), each HTTP/1 connection's header-read timer (`timer`), and an idle HTTP/1 connection parked
//! without hyper's buffers (`idle`). A request enters here and leaves for the executor.

pub mod http;
pub mod idle;
pub mod replay;
pub mod selfwake;
pub mod send_deadline;
pub mod server;
pub mod stop;
pub mod timer;
