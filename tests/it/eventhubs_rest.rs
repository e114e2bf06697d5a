//! The Event Hubs emulator's REST face, as Azure answers `GET https://{namespace}/{hub}`
//! ("Get Event Hub"): a `Date` on every answer, on the emulator's clock; 401 with Service
//! Bus's `<Error>` body (`MissingToken`) without a valid SAS token; the hub's
//! `EventHubDescription` with one; the namespace root's feed to anyone.

use std::time::{Duration, SystemTime};

use hubguard::azure::SasKey;
use hubguard::emulator::eventhubs::{EventHubsConfig, EventHubsEmulator, HubSpec};
use hubguard::emulator::sas::SasCredential;

async fn get(url: &str, token: Option<&str>) -> (u16, Option<SystemTime>, String) {
    let client = reqwest::Client::new();
    let mut request = client.get(url);
    if let Some(t) = token {
        request = request.header("authorization", t);
    }
    let response = crate::common::within("GET", request.send()).await.unwrap();
    let status = response.status().as_u16();
    let date = response
        .headers()
        .get("date")
        .and_then(|d| d.to_str().ok())
        .and_then(hubguard::clock::parse_http_date);
    let body = crate::common::within("body", response.text())
        .await
        .unwrap();
    (status, date, body)
}

#[tokio::test]
async fn it_answers_as_azure_does_and_dates_every_answer_on_its_clock() {
    let emu = EventHubsEmulator::start(EventHubsConfig {
        hubs: vec![HubSpec::new("hub", 2)],
        ..Default::default()
    })
    .await
    .unwrap();
    let base = emu.rest_endpoint().expect("a REST endpoint");
    let hub = format!("{base}hub?api-version=2014-01");

    // No token: 401, Service Bus's error body, and a Date.
    let (status, date, body) = get(&hub, None).await;
    assert_eq!(status, 401, "{body}");
    assert!(date.is_some(), "a Date on the 401");
    assert!(
        body.starts_with(
            "<Error><Code>401</Code><Detail>MissingToken: The authorization header was not found."
        ),
        "{body}"
    );

    // A token signed with another key: 401 too.
    let wrong = SasCredential::new(
        SasKey::new("RootManageSharedAccessKey", "wrong"),
        "sb://x/hub",
    );
    let (status, _, body) = get(&hub, Some(&wrong.token_at(SystemTime::now()).0)).await;
    assert_eq!(status, 401, "{body}");

    // An Entra ID token, which the emulator cannot verify (taken only with
    // --accept-any-token): 401.
    let (status, _, body) = get(&hub, Some("Bearer eyJ0eXAiOiJKV1QifQ.e30.sig")).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("--accept-any-token"), "{body}");

    // A valid token: the hub's description; an unknown hub: the empty feed.
    let key = SasKey::new(
        hubguard::emulator::DEFAULT_KEY_NAME,
        hubguard::emulator::DEFAULT_KEY,
    );
    let good = SasCredential::new(key, format!("{base}hub"));
    let token = good.token_at(SystemTime::now()).0;
    let (status, date, body) = get(&hub, Some(&token)).await;
    assert_eq!(status, 200, "{body}");
    assert!(date.is_some());
    assert!(
        body.contains("<PartitionCount>2</PartitionCount>")
            && body.contains("<d2p1:string>1</d2p1:string>"),
        "{body}"
    );
    let all = SasCredential::new(
        SasKey::new(
            hubguard::emulator::DEFAULT_KEY_NAME,
            hubguard::emulator::DEFAULT_KEY,
        ),
        base.clone(),
    );
    let (status, _, body) = get(
        &format!("{base}nohub?api-version=2014-01"),
        Some(&all.token_at(SystemTime::now()).0),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("<feed") && !body.contains("<entry"),
        "{body}"
    );

    // The namespace root answers anyone.
    let (status, _, body) = get(&base, None).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Publicly Listed Services"), "{body}");

    // Its clock an hour ahead: so is every Date.
    emu.clock().advance(Duration::from_secs(3600));
    let before = SystemTime::now();
    let (status, date, _) = get(&hub, None).await;
    assert_eq!(status, 401);
    let ahead = date.unwrap().duration_since(before).unwrap_or_default();
    // Whole seconds: at least an hour less the second the Date drops.
    assert!(ahead >= Duration::from_secs(3599), "{ahead:?}");
}
