//! The log endpoint's ledger as the machine applies it.

use super::*;

#[test]
fn log_offsets_store_each_byte_once_and_refuse_gaps() {
    let mut world = World::new(0);
    let (exe, _) = world.submit(run("a"));
    let exe = exe.as_str();
    let (step, len) = world.machine.log(exe, 0, 0, b"hello ").expect("appended");
    assert_eq!(len, 6);
    assert!(matches!(step.writes.as_slice(), [Write::Log { offset: 0, data, .. }] if data == b"hello "));
    let (step, len) = world.machine.log(exe, 0, 0, b"hello ").expect("a retried chunk is acknowledged");
    assert_eq!(len, 6);
    assert!(step.writes.is_empty(), "and stored once");
    let (step, len) = world.machine.log(exe, 3, 0, b"lo world").expect("overlapping");
    assert_eq!(len, 11);
    assert!(matches!(step.writes.as_slice(), [Write::Log { offset: 6, data, .. }] if data == b"world"));
    assert_eq!(
        world.machine.log(exe, 12, 0, b"!").map(|(_, n)| n),
        Err(LogError::Conflict { offset: 12, dropped: 0, received: 11 })
    );
}
