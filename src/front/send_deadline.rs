//! A deadline on writing to a client: `server.send_timeout` (nginx's `send_timeout`, Go's
//! `WriteTimeout` per write).
//!
//! hyper's servers have no write timeout. A client that sends a request and then reads nothing
//! fills its receive buffer and the gateway's send buffer, and from then on hyper waits for the
//! socket to become writable for ever: the connection, its task, the request — and, for a
//! stream, the upstream connection and the backend's work behind it, since the gateway stops
//! reading the upstream when it cannot write — are held as long as the client likes. With this
//! wrapper a write that makes no progress for `send_timeout` fails with `TimedOut`, hyper closes
//! the connection, and the request unwinds as a client that left (`client_closed`).
//!
//! Only a write that is *waiting* is timed: the clock starts when the socket first says "not
//! now" and stops at the next byte written, so a slow reader that keeps reading is never cut,
//! and a write that goes straight through costs one branch.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use hyper::rt::{Read, ReadBufCursor, Write};
use tokio::time::{Instant, Sleep};

/// `T` with its writes under a deadline of `limit` without progress.
pub struct SendDeadline<T> {
    inner: T,
    limit: Duration,
    /// Armed while a write waits; made on the first wait and reset after.
    timer: Option<Pin<Box<Sleep>>>,
    waiting: bool,
}

impl<T> SendDeadline<T> {
    /// The socket (a parked connection waits for it to be readable: `front::idle`).
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    pub fn new(inner: T, limit: Duration) -> Self {
        SendDeadline {
            inner,
            limit,
            timer: None,
            waiting: false,
        }
    }

    /// What a write (or flush) of the inner I/O returned, with the deadline applied: progress
    /// disarms it; the first "not now" arms it; "not now" past it is an error.
    fn timed<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if polled.is_ready() {
            self.waiting = false;
            return polled;
        }
        if !self.waiting {
            self.waiting = true;
            let deadline = Instant::now() + self.limit;
            match self.timer.as_mut() {
                Some(t) => t.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        if let Some(t) = self.timer.as_mut() {
            ready!(t.as_mut().poll(cx));
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client took nothing for server.send_timeout ({}ms)",
                    self.limit.as_millis()
                ),
            )));
        }
        Poll::Pending
    }
}

impl<T: Read + Unpin> Read for SendDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for SendDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.timed(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.timed(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.timed(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.timed(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper_util::rt::TokioIo;
    use tokio::io::AsyncReadExt;

    /// Writes `n` bytes through hyper's `Write` (as hyper does), a chunk at a time.
    async fn write_all<W: Write + Unpin>(w: &mut W, mut n: usize) -> io::Result<()> {
        let chunk = [b'x'; 1024];
        while n > 0 {
            let len = n.min(chunk.len());
            let wrote =
                std::future::poll_fn(|cx| Pin::new(&mut *w).poll_write(cx, &chunk[..len])).await?;
            n -= wrote;
        }
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_takes_nothing_fails_the_write_at_the_deadline() {
        let (ours, _theirs) = tokio::io::duplex(4096);
        let mut w = SendDeadline::new(TokioIo::new(ours), Duration::from_secs(5));
        let t0 = Instant::now();
        // 4 KiB fit in the pipe at once; the rest waits for a reader that never reads.
        let err = write_all(&mut w, 64 * 1024).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(t0.elapsed(), Duration::from_secs(5));
        assert!(
            err.to_string().contains("server.send_timeout (5000ms)"),
            "{err}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_reading_is_never_cut() {
        let (ours, mut theirs) = tokio::io::duplex(1024);
        let mut w = SendDeadline::new(TokioIo::new(ours), Duration::from_secs(5));
        // Reads 1 KiB every 4 s: each wait is shorter than the deadline, the whole far longer.
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let mut got = 0;
            while got < 32 * 1024 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                got += theirs.read(&mut buf).await.unwrap();
            }
            got
        });
        let t0 = Instant::now();
        write_all(&mut w, 32 * 1024).await.unwrap();
        assert!(
            t0.elapsed() > Duration::from_secs(100),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(reader.await.unwrap(), 32 * 1024);
    }
}
