//! How the server reaches its clients. The round loop sees only [`Transport`]:
//! hand out a round's tasks with the packed global model, then collect one
//! [`ClientOutcome`] per task, in whatever order they finish. Two transports
//! implement it:
//!
//! * [`crate::pool::WorkerPool`]: `clients.comm_simulation = true`, the
//!   clients run on worker threads of this process;
//! * [`crate::grpc::GrpcTransport`]: `comm_simulation = false`, the clients are
//!   separate `cohort client` processes, on this machine or others.
//!
//! Both move the same bytes (the configured processor pipelines run on both
//! sides either way), so byte counts and processing costs are real in the
//! simulation too.

use std::sync::Arc;

use cohort_train::trainer::ClientTask;

use crate::client::ClientReply;

/// One logical client's task in a round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TaskSpec {
    /// Position in the round's selection order.
    pub slot: usize,
    pub task: ClientTask,
    pub learning_rate: f64,
}

/// A task's result as the server sees it.
#[derive(Debug)]
pub struct ClientOutcome {
    pub slot: usize,
    pub task: ClientTask,
    /// The physical worker that ran it.
    pub worker: usize,
    pub result: Result<Delivered, String>,
}

/// A reply that reached the server.
#[derive(Debug)]
pub struct Delivered {
    pub reply: ClientReply,
    /// Seconds on the wire: the task's round trip as the server measured it,
    /// less the client's own training and processing time. 0 in process.
    pub comm_time: f64,
}

pub trait Transport {
    /// Starts `tasks`; each client receives `global_payload` (the global model
    /// after `server.outbound_processors`).
    fn dispatch(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        tasks: Vec<TaskSpec>,
    ) -> anyhow::Result<()>;

    /// The next finished task of those dispatched. Errors only when the
    /// transport itself is broken; a failed client is an `Err` result inside
    /// the outcome.
    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome>;

    /// Drops tasks not yet started (the run is stopping early).
    fn cancel(&mut self);
}
