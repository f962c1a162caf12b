//! The in-process transport: a fixed pool of physical workers
//! (`trainer.max_concurrency` threads) reused for every logical client.
//!
//! Each worker owns one [`ClientRunner`] (one model instance) and its own rayon
//! pool of `threads_per_worker` compute threads, so workers never fight over
//! one global thread pool. Tasks are taken from a shared queue in order; which
//! worker runs which client does not change any result, because every random
//! stream is derived from the logical client, round and epoch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use cohort_core::data::Dataset;

use crate::client::{ClientPartitions, ClientRunner};
use crate::transport::{ClientOutcome, Delivered, TaskSpec, Transport};

struct Job {
    spec: TaskSpec,
    payload: Arc<Vec<u8>>,
}

pub struct WorkerPool {
    jobs: Option<Sender<Job>>,
    cancelled: Arc<AtomicBool>,
    results: Receiver<ClientOutcome>,
    handles: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts one thread per runner; `partitions.train[c - 1]` is client `c`'s data.
    pub fn start(
        runners: Vec<ClientRunner>,
        data: Arc<Dataset>,
        partitions: Arc<ClientPartitions>,
        threads_per_worker: usize,
    ) -> anyhow::Result<Self> {
        let (job_sender, job_receiver) = mpsc::channel::<Job>();
        let job_receiver = Arc::new(Mutex::new(job_receiver));
        let (result_sender, results) = mpsc::channel();
        let mut handles = Vec::new();
        let cancelled = Arc::new(AtomicBool::new(false));
        for (worker, mut runner) in runners.into_iter().enumerate() {
            let compute = rayon::ThreadPoolBuilder::new()
                .num_threads(threads_per_worker)
                .thread_name(move |i| format!("cohort-worker{worker}-compute{i}"))
                .build()?;
            let jobs = Arc::clone(&job_receiver);
            let results = result_sender.clone();
            let data = Arc::clone(&data);
            let partitions = Arc::clone(&partitions);
            let cancelled = Arc::clone(&cancelled);
            let handle = std::thread::Builder::new()
                .name(format!("cohort-worker{worker}"))
                .spawn(move || {
                    loop {
                        let next = jobs.lock().map(|receiver| receiver.recv());
                        let Ok(Ok(job)) = next else { break };
                        if cancelled.load(Ordering::Relaxed) {
                            break;
                        }
                        let TaskSpec {
                            slot,
                            task,
                            instructions,
                        } = job.spec;
                        let index = task.client_id as usize - 1;
                        let (partition, held_out) =
                            (&partitions.train[index], &partitions.test[index]);
                        let result = compute
                            .install(|| {
                                runner.run(
                                    task,
                                    &instructions,
                                    &job.payload,
                                    &data,
                                    partition,
                                    held_out,
                                )
                            })
                            .map(|reply| Delivered {
                                reply,
                                comm_time: 0.0,
                                declared: None,
                            })
                            .map_err(|error| error.to_string());
                        let outcome = ClientOutcome {
                            slot,
                            task,
                            worker,
                            result,
                        };
                        if results.send(outcome).is_err() {
                            break;
                        }
                    }
                })?;
            handles.push(handle);
        }
        Ok(Self {
            jobs: Some(job_sender),
            cancelled,
            results,
            handles,
        })
    }
}

impl Transport for WorkerPool {
    fn dispatch(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        tasks: Vec<TaskSpec>,
    ) -> anyhow::Result<()> {
        let jobs = self.jobs.as_ref().expect("jobs sender lives until drop");
        for spec in tasks {
            jobs.send(Job {
                spec,
                payload: Arc::clone(&global_payload),
            })
            .map_err(|_| anyhow::anyhow!("all workers have stopped"))?;
        }
        Ok(())
    }

    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
        self.results.recv().map_err(|_| {
            anyhow::anyhow!("a worker thread stopped unexpectedly (it may have panicked)")
        })
    }

    fn cancel(&mut self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.jobs.take();
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}
